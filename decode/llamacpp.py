"""llama.cpp as a peer engine: built once from the llama.cpp that the `llama-cpp-python` sdist vendors, then run
as its own command-line tools (plain greedy decoding, speculative decoding with a draft GGUF, n-gram modes).

The build lives under the cache dir, one folder per sdist version and CPU kind: GGML_NATIVE compiles for the
building CPU, so an AVX-512 build must not run on an AVX2-only machine. It is all-or-nothing like the vLLM venv
(decode/vllm_venv.py): everything is built in a work folder, the tools are copied into a staging folder whose
marker file is written last, and the staging folder is renamed into place; a folder without the marker (a killed
build) is rebuilt from scratch. The tools are linked statically, so they run without LD_LIBRARY_PATH.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from infra.cli import PolyspecError

SDIST = "llama-cpp-python==0.3.36"
TOOLS = ("llama-speculative-simple", "llama-quantize", "llama-tokenize")
MARKER = ".polyspec-llamacpp"
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DGGML_CCACHE=OFF",
)
SIMD_FLAG = re.compile(r"^(avx|sse|ssse|fma|f16c|bmi|amx|vaes|vpclmul|gfni)")


class LlamaCppError(PolyspecError, RuntimeError):
    """llama.cpp could not be built or one of its tools failed; the message is one line and names the log."""


def cpu_kind() -> str:
    """`avx512-<hash>` / `avx2-<hash>` / `generic-<hash>`: the widest vector ISA and a hash of every SIMD flag,
    since a native build uses whatever extensions the building CPU has (VNNI, BF16...)."""
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    simd = sorted(f for f in flags if SIMD_FLAG.match(f))
    widest = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "generic"
    return f"{widest}-{hashlib.sha256(' '.join(simd).encode()).hexdigest()[:8]}"


def default_folder() -> Path:
    from data.models import cache_dir

    version = SDIST.split("==")[1]
    return cache_dir() / "llamacpp" / f"{version}-{cpu_kind()}"


def is_ready(folder: Path) -> bool:
    marker = folder / MARKER
    return marker.exists() and marker.read_text().strip() == SDIST and all((folder / "bin" / t).exists() for t in TOOLS)


def _step(args: list[str], log: Path, cwd: Path | None = None) -> None:
    with log.open("a") as fh:
        fh.write(f"$ {' '.join(args)}\n")
        fh.flush()
        try:
            done = subprocess.run(args, stdout=fh, stderr=subprocess.STDOUT, cwd=cwd)
        except FileNotFoundError:
            raise LlamaCppError(f"building llama.cpp needs `{args[0]}`, which is not installed; see {log}") from None
    if done.returncode:
        raise LlamaCppError(f"building llama.cpp failed at `{' '.join(args[:3])}` (exit {done.returncode}); see {log}")


def _vendored_source(work: Path, log: Path) -> Path:
    """Download the sdist (pip, no build) and extract only its vendored llama.cpp."""
    _step([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:", SDIST,
           "-d", str(work)], log)
    sdist = next(work.glob("llama_cpp_python-*.tar.gz"), None)
    if sdist is None:
        raise LlamaCppError(f"pip download of {SDIST} left no sdist in {work}; see {log}")
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name]
        tar.extractall(work / "src", members=members, filter="data")
    source = next((work / "src").glob("*/vendor/llama.cpp"), None)
    if source is None or not (source / "CMakeLists.txt").exists():
        raise LlamaCppError(f"{sdist.name} vendors no llama.cpp; see {log}")
    return source


def _remove_stale_work(parent: Path) -> None:
    """Work folders of builds that were killed (their pid is gone)."""
    for stale in parent.glob(".*.work-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(stale, ignore_errors=True)


def _compile(source: Path, build: Path, log: Path, jobs: int) -> None:
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    _step(["cmake", "-S", str(source), "-B", str(build), *generator, *CMAKE_OPTIONS], log)
    _step(["cmake", "--build", str(build), "-j", str(jobs), "--target", *TOOLS], log)


def ensure_built(folder: Path | None = None, jobs: int | None = None) -> Path:
    """The folder of the built tools (`<folder>/bin`), building llama.cpp first when it is missing or unfinished
    (tens of minutes on two cores; ~1 GB of work space while it builds, a few MB after)."""
    folder = Path(folder or default_folder()).expanduser()
    if is_ready(folder):
        return folder / "bin"
    folder.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_work(folder.parent)
    work = folder.parent / f".{folder.name}.work-{os.getpid()}"
    log = folder.with_name(f"{folder.name}-build.log")
    log.write_text("")
    print(f"llama.cpp: building {SDIST}'s vendored llama.cpp into {folder} (once; tens of minutes; log {log})",
          file=sys.stderr)
    try:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        _compile(_vendored_source(work, log), work / "build", log, jobs or os.cpu_count() or 1)
        staging = work / "done"
        (staging / "bin").mkdir(parents=True)
        for tool in TOOLS:
            shutil.copy2(work / "build" / "bin" / tool, staging / "bin" / tool)
        (staging / MARKER).write_text(SDIST + "\n")
        if not is_ready(folder):  # another process may have finished the same build first
            shutil.rmtree(folder, ignore_errors=True)
            staging.rename(folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return folder / "bin"
