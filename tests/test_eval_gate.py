"""decode.eval end to end on tiny random models: decode, check, report, and publish only what passes."""
from __future__ import annotations

import json

import pytest
import torch

from data.tracking import Tracker
from decode.baselines import autoregressive
from decode.chain import Chain, ModelLevel
from decode.eval import conclude, decode_questions, top2_margin
from eval_fixtures import EOS, QUESTIONS, AcceptEverything, ByteTokenizer, SlowModel, eval_cfg
from decode_fixtures import noisy_copy, tiny_model

DRAFT = {"mode": "chain", "length": 4}
LEVELS = {  # what the config says about each level (only names and sources matter to the gate)
    "target": {"kind": "model", "name": "target", "model": "target"},
    "w4": {"kind": "model", "name": "w4", "model": "w4", "mu": 4},
    "draft": {"kind": "model", "name": "draft", "model": "draft", "draft": DRAFT},
}


@pytest.fixture(scope="module")
def models():
    """The target, a close copy (the W4 stand-in) and a rougher one (the drafter); one thread, since two
    threads of tiny matmuls only spin against each other on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    target = tiny_model(0)
    yield target, noisy_copy(target, 0.05, seed=1), noisy_copy(target, 0.3, seed=2)
    torch.set_num_threads(threads)


def dualistic(models):
    target, _, drafter = models
    return Chain([ModelLevel("target", target), ModelLevel("draft", drafter, draft=DRAFT)])


def run_eval(models, tmp_path, chains: dict[str, Chain], **cfg_kwargs):
    target = models[0]
    decoders = {"ar": lambda p, n: autoregressive(target, p, n, eos_token_id=EOS)}
    decoders |= {name: (lambda p, n, c=chain: c.generate(p, n, eos_token_id=EOS)) for name, chain in chains.items()}
    records = decode_questions(decoders, QUESTIONS, ByteTokenizer(), max_new_tokens=12, warmup_tokens=4)
    names = {name: [level.name for level in chain.levels] for name, chain in chains.items()}
    cfg = eval_cfg(tmp_path, {name: [LEVELS[n] for n in levels] for name, levels in names.items()}, **cfg_kwargs)
    code = conclude(cfg, records, names, lambda ids: top2_margin(target, ids), "hash", Tracker(cfg, "eval"), len(QUESTIONS))
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    return code, report, {c["name"]: c for c in report["checks"]}


def test_slow_inserted_level_is_rejected_and_nothing_is_published(models, tmp_path, capsys):
    target, w4, drafter = models
    slow = Chain([ModelLevel("target", target), ModelLevel("w4", SlowModel(w4, 0.03), mu=4), ModelLevel("draft", drafter, draft=DRAFT)])
    code, report, checks = run_eval(models, tmp_path, {"dualistic": dualistic(models), "polybasic": slow})
    assert code == 2 and not (tmp_path / "publish").exists()
    assert checks["lossless"]["passed"], checks["lossless"]["reasons"]
    assert not checks["insertion"]["passed"]
    (ins,) = report["insertions"]
    assert ins["level"] == "w4" and ins["values"]["T_new"] > 0.03 and not ins["improves"]
    assert "check failed: insertion: w4 between target and draft does not pay for itself" in capsys.readouterr().err
    assert report["gate"]["decision"] == "not published"
    out = tmp_path / "eval"
    for name in ("report.md", "speedup_by_category.png", "acceptance_polybasic.png", "predicted_vs_measured.png", "metrics.json"):
        assert (out / name).stat().st_size > 0
    md = (out / "report.md").read_text()
    assert "| w4 in polybasic (vs dualistic) |" in md and "rejected" in md and "**Gate: not published.**" in md
    # multi-turn: the second turn's prompt holds the first answer, and every method saw the same prompts
    turns = [r for r in report["records"]["polybasic"] if r["question_id"] == 1]
    assert [r["turn"] for r in turns] == [0, 1] and turns[1]["prompt_len"] > turns[0]["prompt_len"]
    # per question and per category: speedup over AR, T_i and L_i (mean, variance) for every level
    assert all(r["speedup"] > 0 and len(r["levels"]) == 3 for r in report["records"]["polybasic"])
    math = report["categories"]["math"]["polybasic"]
    assert len(math["T_s"]) == 3 and len(math["L"]) == len(math["L_var"]) == 2


def test_lossy_chain_fails_the_lossless_check(models, tmp_path, capsys):
    target, _, drafter = models
    lossy = Chain([AcceptEverything("target", target), ModelLevel("draft", drafter, draft=DRAFT)])
    code, report, checks = run_eval(models, tmp_path, {"lossy": lossy}, tolerance=100.0)
    assert code == 2 and not (tmp_path / "publish").exists()
    assert not checks["lossless"]["passed"] and checks["insertion"]["passed"]
    assert "check failed: lossless: lossy: question 1 turn 1: token" in capsys.readouterr().err


def test_passing_chain_is_published_with_its_manifest(models, tmp_path):
    code, report, checks = run_eval(models, tmp_path, {"dualistic": dualistic(models)}, tolerance=100.0)
    assert code == 0 and all(c["passed"] for c in checks.values())
    manifest = json.loads((tmp_path / "publish" / "chain.json").read_text())
    assert manifest["forced"] is False and manifest["failed_checks"] == []
    assert [lvl["config"]["name"] for lvl in manifest["levels"]] == ["target", "draft"]
    assert manifest["levels"][0]["content_hash"] == "hash" and manifest["versions"]["torch"]
    assert (tmp_path / "publish" / "report" / "report.md").exists()


def test_force_publishes_despite_failures_and_records_it(models, tmp_path):
    target, w4, drafter = models
    (tmp_path / "w4").mkdir()
    (tmp_path / "w4" / "model.safetensors").write_bytes(b"w4 weights")
    slow = Chain([ModelLevel("target", target), ModelLevel("w4", SlowModel(w4, 0.03), mu=4), ModelLevel("draft", drafter, draft=DRAFT)])
    code, report, checks = run_eval(models, tmp_path, {"polybasic": slow, "dualistic": dualistic(models)}, force=True)
    assert code == 0 and not checks["insertion"]["passed"]
    manifest = json.loads((tmp_path / "publish" / "chain.json").read_text())
    assert manifest["forced"] is True and any("insertion" in line for line in manifest["failed_checks"])
    assert manifest["levels"][1]["bundled_as"] == "levels/w4"
    assert (tmp_path / "publish" / "levels" / "w4" / "model.safetensors").read_bytes() == b"w4 weights"
    assert report["gate"]["decision"] == "published (forced)"
