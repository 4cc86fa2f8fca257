"""An EAGLE-3 head trained by train.eagle (train=eagle3) on the real default, then loaded unchanged by the real
consumers through decode.interop: vLLM (method eagle3) and llama.cpp (its own converter, draft-eagle3). A few
dozen steps train a head that accepts enough for the acceptance comparison to mean something: a wrong layout
or an off-by-one aux layer accepts ~nothing in an engine while polyspec's own decoding accepts, and check (b) then
fails (an engine's L must reach 1 + half of polyspec's L - 1, which is above 1.025 here)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TRAIN = ["train=eagle3", "train.max_conversations=64", "train.max_len=256", "train.grad_accum=2", "train.max_steps=60",
         "train.warmup_steps=5", "train.eval_every=0", "train.checkpoint_every=1000", "train.eval.conversations=8",
         "train.eval.gen_tokens=32"]


def _run(module: str, *args: str, timeout: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, WANDB_MODE="disabled")
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_vllm_and_llamacpp_serve_a_trained_eagle3_head_unchanged(tmp_path):
    trained = _run("train.eagle", f"run_dir={tmp_path}", *TRAIN, timeout=1800)
    assert trained.returncode == 0, (trained.stdout + trained.stderr)[-3000:]
    head = tmp_path / "eagle3"
    config = json.loads((head / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] < config["vocab_size"]
    done = _run("decode.interop", f"run_dir={tmp_path}", f"interop.head={head}", "interop.checks.w4=false",
                "interop.llamacpp=true", "interop.max_new_tokens=48", timeout=2400)
    log = (done.stdout + done.stderr)[-3000:]
    record = json.loads((tmp_path / "interop" / "interop.json").read_text())
    checks = {c["name"]: c for c in record["checks"]}
    for name in ("head_lossless", "acceptance", "llamacpp_head_lossless", "llamacpp_acceptance"):
        assert checks[name]["passed"] is True, (checks[name], log)
    assert record["polyspec"]["chain"]["acceptance_length"] > 1.05, log  # the head accepts: (b) compares something
    assert done.returncode == 0, log
