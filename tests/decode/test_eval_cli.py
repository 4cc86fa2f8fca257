"""`python -m decode.eval` as a user runs it: one-line errors on bad input, and a real (short) run."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_eval(tmp_path, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "disabled"}
    return subprocess.run(
        [sys.executable, "-m", "decode.eval", f"run_dir={tmp_path}", *overrides],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )


def compose(tmp_path, *overrides: str):
    from hydra import compose as hydra_compose, initialize

    with initialize(version_base="1.3", config_path="../../conf"):
        return hydra_compose("config", overrides=[f"run_dir={tmp_path}", *overrides])


@pytest.mark.parametrize("override,message", [
    ("eval.prompts=/nonexistent/question.jsonl", "/nonexistent/question.jsonl: no such question file"),
    ("eval.publish.chain=nope", "eval.publish.chain='nope' is not one of eval.chains"),
    ("eval.max_new_tokens=0", "eval.max_new_tokens must be an integer >= 1"),
    ("eval.confidence=1.5", "eval.confidence must be a number strictly between 0 and 1, got 1.5"),
])
def test_bad_input_is_refused_before_any_work(tmp_path, override, message):
    from data.sharegpt import DataError
    from decode.evaluation import EvalError
    from decode.eval import run
    from decode.settings import eval_of

    with pytest.raises((EvalError, DataError), match=re.escape(message)) as err:
        run(eval_of(compose(tmp_path, override)))
    assert "\n" not in str(err.value)
    assert not any(tmp_path.iterdir())


def test_cli_prints_one_line_error_and_exits_2(tmp_path):
    proc = run_eval(tmp_path, "eval.prompts=/nonexistent/question.jsonl")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == "error: /nonexistent/question.jsonl: no such question file"
    assert "Traceback" not in proc.stderr and not (tmp_path / "publish").exists()


@pytest.mark.slow
def test_smoke_eval_on_the_bundled_model_evaluates_every_check(tmp_path):
    """About 1-2 minutes on a quiet CPU (10 under heavy contention): the bundled target with stand-in
    levels (eval=smoke) on three short Spec-Bench questions, one of them multi-turn, 16 tokens each."""
    questions = tmp_path / "question.jsonl"
    questions.write_text("\n".join(json.dumps(q) for q in [
        {"question_id": 1, "category": "writing", "turns": ["Name two colours.", "Now one more."]},
        {"question_id": 2, "category": "translation", "turns": ["Translate into French: good morning."]},
        {"question_id": 3, "category": "math", "turns": ["What is 7 times 8?"]},
    ]))
    proc = run_eval(tmp_path, "eval=smoke", f"eval.prompts={questions}", "eval.max_new_tokens=16", timeout=1200)
    assert proc.returncode in (0, 3), proc.stderr[-3000:]  # 3: nothing published
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert set(checks) == {"lossless", "insertion", "agreement"}
    assert checks["lossless"]["passed"], checks["lossless"]["reasons"]
    assert report["questions"] == 3 and list(report["categories"]) == ["writing", "translation", "math"]
    assert {i["level"] for i in report["insertions"]} == {"exit12"}  # configured chains, and planned ones
    # the planner also searched the one other stack these levels allow, and decoded it (eval.plan.stacks: 2)
    assert set(report["plans"]) == {"dualistic", "polybasic", "target<-exit12"}
    stack = report["plans"]["target<-exit12"]
    assert stack["stack"] and stack["decoded"] == ["planned"] and "configured" not in stack
    assert stack["planned"]["measured_s_per_token"] > 0 and "target<-exit12" in report["chains"]
    assert stack["levels"][-1]["draft"] == stack["planned"]["knobs"]["draft"]
    published = (tmp_path / "publish" / "chain.json").exists()
    assert published == (proc.returncode == 0) == bool(report["gate"]["admissible"])
    if published:
        manifest = json.loads((tmp_path / "publish" / "chain.json").read_text())
        interval = report["chains"][manifest["chain"]]["time_speedup_interval"]
        assert manifest["chain"] == report["gate"]["chain"]
        assert manifest["measured"]["speedup_over_ar_interval"] == interval
    for reason in (r for c in checks.values() for r in c["reasons"]):
        assert reason in proc.stderr
    assert report["gate"]["explanation"] in (tmp_path / "eval" / "report.md").read_text()
    # every speedup carries its interval, and only a shown one is published
    for name, result in report["chains"].items():
        interval = result["time_speedup_interval"]
        assert interval["turns"] == 4 and interval["text"] in (tmp_path / "eval" / "report.md").read_text()
        assert (name in report["gate"]["admissible"]) <= (interval["low"] > 1)
