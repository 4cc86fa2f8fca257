"""scripts/test.sh, the README's test command, on a stand-in pytest: every stage runs whatever the one before did,
and the script fails at the end if any stage failed or collected nothing (pytest's exit code 5)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FAKE_PYTHON = """#!/usr/bin/env bash
# pytest as the script calls it: records the stage (its -m selection and ATEN_CPU_CAPABILITY), exits as told
selection=$4
echo "$selection|${ATEN_CPU_CAPABILITY:-}" >> "$STAGES"
case "$selection" in
    "not slow") exit "$FAST_RC" ;;
    "slow") exit "$SLOW_RC" ;;
    *) exit "$KERNELS_RC" ;;
esac
"""


def run_test_script(tmp_path: Path, fast: int, kernels: int, slow: int) -> tuple[int, list[str], str]:
    """test.sh copied beside a setup.sh that installs nothing, with `python` the stand-in: (exit code, the stages
    run in order, stderr)."""
    (tmp_path / "scripts").mkdir(exist_ok=True)
    shutil.copy(REPO / "scripts" / "test.sh", tmp_path / "scripts" / "test.sh")
    (tmp_path / "scripts" / "setup.sh").write_text("exit 0\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python").write_text(FAKE_PYTHON)
    (bin_dir / "python").chmod(0o755)
    stages = tmp_path / "stages.txt"
    stages.unlink(missing_ok=True)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", STAGES=str(stages), FAST_RC=str(fast),
               KERNELS_RC=str(kernels), SLOW_RC=str(slow))
    done = subprocess.run(["bash", str(tmp_path / "scripts" / "test.sh")], env=env, capture_output=True, text=True,
                          timeout=300)
    return done.returncode, stages.read_text().splitlines(), done.stderr


def expected_stages() -> list[str]:
    kernels = ["cpu_kernels and not slow|avx2"] if "avx512f" in Path("/proc/cpuinfo").read_text().split() else []
    return ["not slow|", *kernels, "slow|"]


@pytest.mark.parametrize("fast,kernels,slow", [(0, 0, 0), (1, 0, 0), (0, 1, 0), (5, 0, 0), (0, 0, 5), (1, 1, 1)])
def test_every_stage_runs_and_any_failure_fails_the_script(tmp_path, fast, kernels, slow):
    code, stages, err = run_test_script(tmp_path, fast, kernels, slow)
    assert stages == expected_stages()
    kernel_ran = len(stages) == 3
    failed = [rc for rc in (fast, kernels if kernel_ran else 0, slow) if rc]
    assert (code != 0) == bool(failed), err
    assert err.count("failed stage:") == len(failed), err
    if 5 in (fast, slow):
        assert "no tests collected" in err
