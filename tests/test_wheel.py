"""The package as a user installs it: the wheel built from this tree, installed into a fresh venv (the project's
dependencies from this environment, polyspec itself only from the wheel), decodes a chain from another folder,
its W4 level on the native runner compiled from the packaged C++ sources."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from w4_fixtures import stage_config

REPO = Path(__file__).resolve().parents[1]


def run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(args, capture_output=True, text=True, timeout=1200, **kwargs)
    assert done.returncode == 0, (args, (done.stdout + done.stderr)[-3000:])
    return done


@pytest.mark.slow
def test_the_wheel_installs_and_decodes_a_chain_on_the_native_runner(tiny_source, chat_file, tmp_path):
    from quantize.settings import w4_of
    from quantize.w4 import run as quantize

    w4 = quantize(w4_of(stage_config(tiny_source, chat_file, tmp_path / "run")))
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"),
         str(REPO)], cwd=tmp_path)
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)])
    python = str(venv / "bin" / "python")
    wheel = next((tmp_path / "dist").glob("polyspec-*.whl"))
    run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = dict(os.environ, POLYSPEC_CACHE=str(tmp_path / "cache"), WANDB_MODE="disabled")
    where = run([python, "-c", "import decode.backends.cpu.llama as m; print(m.__file__)"], cwd=elsewhere, env=env)
    assert where.stdout.strip().startswith(str(venv)), where.stdout
    done = run([python, "-m", "decode.generate", f"model.name={tiny_source}", f"quantize.output={w4}",
                f"run_dir={tmp_path / 'run'}", "chain=w4_lookup", "prompt=the cat sat on the mat", "decode.native=on",
                "decode.max_new_tokens=24", "decode.compare_ar=true"], cwd=elsewhere, env=env)
    assert "outputs identical" in done.stdout, done.stdout[-2000:]
    assert (tmp_path / "cache" / "kernels").is_dir()
