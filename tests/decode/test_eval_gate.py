"""decode.eval end to end on tiny random models: plan, decode, check, report, and publish the best chain
that pays, never one slower than AR. Time is the test's own (the `virtual_clock` fixture): the target sleeps
TARGET_SLEEP_S a forward on it and the tiny models' real work costs next to nothing, so drafting pays as it does for a
real target, and every timing, interval and verdict below follows from the sleeps written here, whatever else the
machine is doing."""
from __future__ import annotations

import json

import pytest
import torch
from decode_fixtures import noisy_copy, tiny_model
from eval_fixtures import EOS, QUESTIONS, AcceptEverything, ByteTokenizer, SlowModel, eval_cfg

from decode.chains.baselines import autoregressive, greedy_margins
from decode.engine.chain import Chain
from decode.engine.levels import ModelLevel
from decode.engine.spec import ChainSpec
from decode.eval import conclude
from decode.settings import eval_of
from decode.evaluation.decoding import Decoded, chain_decoder, decode_questions, decode_sampled, plan_chains
from infra.cli import EXIT_NOT_PUBLISHED
from infra.tracking import Tracker

pytestmark = pytest.mark.usefixtures("virtual_clock")
TARGET_SLEEP_S = 0.03
DRAFT = {"mode": "chain", "length": 4}
LEVELS = {  # what the config says about each level (only names and sources matter to the gate)
    "target": {"kind": "model", "name": "target", "model": "target"},
    "w4": {"kind": "model", "name": "w4", "model": "w4", "mu": 4},
    "draft": {"kind": "model", "name": "draft", "model": "draft", "draft": DRAFT},
}


@pytest.fixture(scope="module")
def models():
    """A slow target (the reference and every chain's level 1), a close copy (the W4 stand-in) and a close
    drafter; one thread, since two threads of tiny matmuls only spin against each other on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    target = tiny_model(0)
    yield SlowModel(target, TARGET_SLEEP_S), noisy_copy(target, 0.02, seed=1), noisy_copy(target, 0.02, seed=2)
    torch.set_num_threads(threads)


def dualistic(models, drafter=None):
    target, _, close = models
    return Chain([ModelLevel("target", target), ModelLevel("draft", drafter or close, draft=DRAFT)])


def slow_polybasic(models):
    target, w4, drafter = models
    return Chain([ModelLevel("target", target), ModelLevel("w4", SlowModel(w4, 3 * TARGET_SLEEP_S), mu=4),
                  ModelLevel("draft", drafter, draft=DRAFT)])


class LevelBuilder:
    """Builds chains from specs on the test's in-memory levels' models (a ChainBuilder loads them instead)."""

    tokenizer = ByteTokenizer()

    def __init__(self, chains: dict[str, Chain]):
        self.levels = {level.name: level for chain in chains.values() for level in chain.levels}

    def build(self, spec: ChainSpec) -> Chain:
        return Chain([type(self.levels[level.name])(level.name, self.levels[level.name].model, level.mu, level.draft)
                      for level in spec.levels])


def run_eval(models, tmp_path, chains: dict[str, Chain], plan: bool = False, **cfg_kwargs):
    target = models[0]
    levels = {name: [LEVELS[level.name] for level in chain.levels] for name, chain in chains.items()}
    settings = eval_of(eval_cfg(tmp_path, levels, **cfg_kwargs))
    decoders = {"ar": lambda p, n, *sampling: autoregressive(target, p, n, *sampling, eos_token_id=EOS)}
    decoders |= {name: chain_decoder(chain, EOS) for name, chain in chains.items()}
    plans = plan_chains(settings, LevelBuilder(chains), decoders, QUESTIONS[:1], EOS) if plan else {}
    records = decode_questions(decoders, QUESTIONS, ByteTokenizer(), max_new_tokens=12, warmup_tokens=4)
    sampled = decode_sampled({n: decoders[n] for n in chains}, QUESTIONS[:2], ByteTokenizer(), 12, 1.0, 0)
    levels |= {p["chain"]: p["levels"] for p in plans.values() if "planned" in p["decoded"]}
    decoded = Decoded(records, levels, len(QUESTIONS), plans, sampled)
    reference = lambda p, forced, n: greedy_margins(target, p, forced, n, EOS)  # noqa: E731
    code = conclude(settings, decoded, reference, "hash", Tracker(settings.tracking, "eval"))
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    return code, report, {c["name"]: c for c in report["checks"]}


def test_rejected_w4_level_still_publishes_target_head(models, tmp_path, capsys):
    code, report, checks = run_eval(models, tmp_path,
                                    {"dualistic": dualistic(models), "polybasic": slow_polybasic(models)})
    out = capsys.readouterr()
    assert checks["lossless"]["passed"], checks["lossless"]["reasons"]
    (ins,) = report["insertions"]
    assert ins["level"] == "w4" and ins["values"]["T_new"] > 3 * TARGET_SLEEP_S and not ins["improves"]
    assert list(checks["insertion"]["by_chain"]) == ["polybasic"]
    assert "check failed: insertion: w4 between target and draft does not pay for itself" in out.err
    assert code == 0 and report["gate"]["chain"] == "dualistic", report["gate"]
    manifest = json.loads((tmp_path / "publish" / "chain.json").read_text())
    assert manifest["chain"] == "dualistic" and manifest["measured"]["speedup_over_ar"] > 1.0
    interval = manifest["measured"]["speedup_over_ar_interval"]
    assert interval["low"] > 1 and interval["text"].endswith(": shown faster") and interval["turns"] == 8
    assert [lvl["config"]["name"] for lvl in manifest["levels"]] == ["target", "draft"]
    assert manifest["levels"][0]["content_hash"] == "hash" and manifest["forced"] is False
    serve = manifest["serve"]  # vLLM has no early-exit drafter: the target alone, and says so
    assert serve["llm_kwargs"] == {"model": "tiny", "dtype": "float32"} and "drafter_not_served" in serve
    assert serve["vllm_serve"] == "vllm serve tiny --dtype float32" and "two levels" in serve["note"]
    assert manifest["checks"] == {"lossless": True, "insertion": True, "agreement": True, "faster_than_ar": True}
    assert any(r.startswith("insertion: w4 between") for r in manifest["rejected"]["polybasic"])
    md = (tmp_path / "eval" / "report.md").read_text()
    corrected = report["gate"]["corrected_intervals"]["dualistic"]  # Holm over the two chains
    assert corrected["low"] <= interval["low"] and corrected["estimate"] == interval["estimate"]
    assert md.splitlines()[2].startswith("**Published: dualistic.** dualistic, "
                                         "the fastest admissible chain by its interval's "
                                         f"lower bound: {corrected['text']} than AR")
    assert "- rejected polybasic: insertion: w4 between target and draft" in md
    assert "| w4 in polybasic (vs dualistic) |" in md and "## Theorem 3.3" in md
    for name in ("report.md", "speedup_by_category.png", "acceptance_polybasic.png", "predicted_vs_measured.png",
                 "metrics.json"):
        assert (tmp_path / "eval" / name).stat().st_size > 0
    assert (tmp_path / "publish" / "report" / "report.md").exists()
    # the refined prediction holds for three levels where Theorem 3.1 does not count the middle level's waste
    poly = report["chains"]["polybasic"]["predictions"]
    assert abs(poly["refined"]["error"]) < abs(poly["paper"]["error"])
    # multi-turn: the second turn's prompt holds the first answer; per turn, speedup, T_i and L_i of every level
    turns = [r for r in report["records"]["polybasic"] if r["question_id"] == 1]
    assert [r["turn"] for r in turns] == [0, 1] and turns[1]["prompt_len"] > turns[0]["prompt_len"]
    assert all(r["speedup"] > 0 and len(r["levels"]) == 3 for r in report["records"]["polybasic"])
    t33 = report["theorem_3_3"]["polybasic"]
    assert [r["level"] for r in t33] == ["target", "w4"] and all(r["sampling"]["verifications"] > 0 for r in t33)


def test_no_chain_slower_than_ar_is_published_and_a_refusal_sets_the_old_bundle_aside(models, tmp_path, capsys):
    assert run_eval(models, tmp_path, {"dualistic": dualistic(models)}, tolerance=100.0)[0] == 0
    (tmp_path / ".publish.tmp-left-over").mkdir()  # an interrupted earlier publish
    slow = dualistic(models, drafter=SlowModel(models[2], 2 * TARGET_SLEEP_S))  # 4 drafts cost 8 target forwards
    capsys.readouterr()
    code, report, checks = run_eval(models, tmp_path, {"dualistic": slow}, tolerance=100.0, force=True)
    out = capsys.readouterr().out
    # every check passed, force too: still refused
    assert code == EXIT_NOT_PUBLISHED and all(c["passed"] for c in checks.values())
    assert report["chains"]["dualistic"]["time_speedup"] < 1 and report["gate"]["decision"] == "not published"
    interval = report["chains"]["dualistic"]["time_speedup_interval"]
    assert interval["high"] < 1 and report["gate"]["rejected"]["dualistic"][-1] == f"faster than AR: {interval['text']}"
    assert not (tmp_path / "publish").exists() and not (tmp_path / ".publish.tmp-left-over").exists()
    assert json.loads((tmp_path / "publish.stale" / "chain.json").read_text())["chain"] == "dualistic"
    assert f"moved the previously published bundle aside to {tmp_path / 'publish.stale'}" in out
    assert f"not published: no chain is shown faster than AR: dualistic {interval['text']} (95% intervals)." in out
    assert "removed a stale temp folder" in out


def test_lossy_chain_fails_the_lossless_check(models, tmp_path, capsys):
    target, _, drafter = models
    lossy = Chain([AcceptEverything("target", target), ModelLevel("draft", drafter, draft=DRAFT)])
    code, report, checks = run_eval(models, tmp_path, {"lossy": lossy}, tolerance=100.0)
    assert code == EXIT_NOT_PUBLISHED and not (tmp_path / "publish").exists()
    assert not checks["lossless"]["passed"] and checks["insertion"]["passed"]
    assert "check failed: lossless: lossy: question 1 turn 1: token" in capsys.readouterr().err


def test_strict_gate_refuses_when_any_check_fails_and_force_records_it(models, tmp_path):
    chains = {"polybasic": slow_polybasic(models), "dualistic": dualistic(models)}
    code, report, _ = run_eval(models, tmp_path, chains, publish="dualistic")
    assert code == EXIT_NOT_PUBLISHED and report["gate"]["explanation"].startswith(
        "eval.publish.chain=dualistic (strict): a check failed")
    (tmp_path / "w4").mkdir()
    (tmp_path / "w4" / "model.safetensors").write_bytes(b"w4 weights")
    code, report, _ = run_eval(models, tmp_path, chains, publish="dualistic", force=True)
    assert code == 0 and report["gate"]["decision"] == "published (forced)"
    manifest = json.loads((tmp_path / "publish" / "chain.json").read_text())
    assert manifest["chain"] == "dualistic" and manifest["forced"] is True
    assert any("insertion" in line for line in manifest["failed_checks"])


def test_planned_chain_runs_next_to_the_configured_one_and_its_plan_is_published(models, tmp_path):
    code, report, checks = run_eval(models, tmp_path, {"dualistic": dualistic(models)}, plan=True, tolerance=100.0)
    plan = report["plans"]["dualistic"]
    assert plan["chain"] in ("dualistic", "dualistic_planned") and plan["chain"] in report["chains"]
    for side in ("configured", "planned"):
        assert plan[side]["predicted"]["s_per_token"] > 0 and plan[side]["measured_s_per_token"] > 0
        assert plan[side]["error"] == pytest.approx(plan[side]["predicted"]["s_per_token"]
                                                    / plan[side]["measured_s_per_token"] - 1)
        name = "dualistic" if side == "configured" else plan["chain"]  # the target's L, as the chain measured it
        assert plan[side]["measured_L"] == [report["summaries"][name]["levels"][0]["L_mean"]]
        assert -1 < plan[side]["cost_error"] < 10  # the plan's costs on the measured acceptance: a time, not a NaN
    assert plan["levels"][-1]["draft"] == plan["planned"]["knobs"]["draft"]
    assert "| error at the eval's L |" in (tmp_path / "eval" / "report.md").read_text()
    assert code == 0, report["gate"]
    manifest = json.loads((tmp_path / "publish" / "chain.json").read_text())
    assert (manifest["plan"]["planned"]["knobs"] == plan["planned"]["knobs"]
            and manifest["measured"]["speedup_over_ar"] > 1)
    if manifest["chain"] == "dualistic_planned":
        assert (manifest["plan"]["published"] == "planned"
                and manifest["levels"][-1]["config"]["draft"] == plan["planned"]["knobs"]["draft"])


def test_a_searched_stack_is_decoded_when_predicted_fastest_and_can_be_published(models, tmp_path):
    """Only target <- slow W4 <- draft is configured; the planner also plans target <- draft, target <- W4 (the W4
    drafting) and target <- draft <- W4. The first is predicted fastest, decoded, and published; the W4 insertion
    fails against it."""
    code, report, checks = run_eval(models, tmp_path, {"polybasic": slow_polybasic(models)}, plan=True,
                                    tolerance=100.0, stacks=1)
    plans = report["plans"]
    assert set(plans) == {"polybasic", "target<-draft", "target<-w4", "target<-draft<-w4"}
    assert plans["target<-draft"]["decoded"] == ["planned"] and plans["target<-w4"]["decoded"] == []
    assert "target<-draft" in report["chains"] and "target<-w4" not in report["chains"]
    assert "measured_s_per_token" not in plans["target<-w4"]["planned"]
    assert {(i["with"], i["without"]) for i in report["insertions"]} >= {("polybasic", "target<-draft")}
    assert code == 0 and report["gate"]["chain"] == "target<-draft", report["gate"]
    manifest = json.loads((tmp_path / "publish" / "chain.json").read_text())
    assert manifest["plan"]["published"] == "stack" and manifest["plan"]["base"] == "target<-draft"
    md = (tmp_path / "eval" / "report.md").read_text()
    assert "| target<-draft (stack) |" in md and "| target<-w4 (stack) |" in md
    plans_off = run_eval(models, tmp_path / "off", {"polybasic": slow_polybasic(models)}, plan=True,
                         tolerance=100.0, stacks=0)[1]["plans"]
    assert set(plans_off) == {"polybasic"}
