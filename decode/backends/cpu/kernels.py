"""Build the project's C++ kernels for this machine, once: compiled with the machine's gcc on first use and
cached under the project's cache dir, keyed by every source and header, the flags and the torch version.

The C++ is headers plus sources: kernels.h (the helpers every kernel shares), kernels.cpp (the packed fp32 product,
attention and the read-bandwidth probe), kernels_module.cpp (their Python module) and decoder.cpp (the native
decoder, its own module, linked with kernels.cpp)."""
from __future__ import annotations

import functools
import hashlib
import sys
import time
from pathlib import Path
from typing import Any

import torch

from data.models import cache_dir

HERE = Path(__file__).parent
HEADERS = (HERE / "kernels.h",)


def build_extension(name: str, sources: tuple[Path, ...], flags: list[str]) -> tuple[Any | None, str]:
    """(the extension module of `sources`, "") or (None, why it did not build: said once on stderr). The cache key
    covers the sources, every header beside them, the flags and torch's version."""
    from torch.utils import cpp_extension

    text = b"".join(p.name.encode() + p.read_bytes() for p in (*sources, *HEADERS))
    key = hashlib.sha256(text + " ".join(flags + [torch.__version__]).encode()).hexdigest()[:12]
    build = cache_dir() / "kernels" / key
    build.mkdir(parents=True, exist_ok=True)
    lock = build / "lock"  # left behind by a build that was killed: torch would wait for it forever
    if lock.exists() and time.time() - lock.stat().st_mtime > 300:
        lock.unlink(missing_ok=True)
    started = time.perf_counter()
    try:
        module = cpp_extension.load(f"{name}_{key}", [str(s) for s in sources], extra_cflags=flags,
                                    extra_ldflags=["-fopenmp"], build_directory=str(build))
    except Exception as err:  # no compiler, no ninja, no Python headers: the caller falls back, said once
        why = (str(err).strip().splitlines() or [type(err).__name__])[-1]
        print(f"decode: the {name} kernels did not build ({why[:200]}); using the fallback", file=sys.stderr)
        return None, why
    if time.perf_counter() - started > 5:
        print(f"decode: built the {name} kernels in {time.perf_counter() - started:.0f} s (cached in {build})",
              file=sys.stderr)
    return module, ""


@functools.cache
def avx2_kernel() -> tuple[Any | None, str]:
    """(kernels.cpp built for this machine: the packed fp32 product and `attend`, "") or (None, why not).
    gcc must be told -fopenmp: without it ATen's parallel_for compiles to a serial loop in an extension."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None, f"the CPU lacks AVX2+FMA ({torch.backends.cpu.get_cpu_capability()})"
    return build_extension("polyspec_kernels", (HERE / "kernels.cpp", HERE / "kernels_module.cpp"),
                           ["-O3", "-mavx2", "-mfma", "-fopenmp"])
