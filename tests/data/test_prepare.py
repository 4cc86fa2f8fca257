"""`python -m data.prepare`, the first thing a new machine runs: model, data and prompts all usable."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_prepare_prints_counts_and_a_reply(tmp_path):
    env = dict(os.environ, WANDB_MODE="disabled")
    out = subprocess.run([sys.executable, "-m", "data.prepare", "data.max_conversations=50", f"run_dir={tmp_path}"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    counts = {line.split(":")[0].strip(): line.split(":", 1)[1].strip()
              for line in out.stdout.splitlines() if ":" in line}
    assert int(counts["train_conversations"]) > 0 and int(counts["held_out_conversations"]) > 0
    assert int(counts["questions"]) == 24 and len(counts["sample reply"]) > 10
