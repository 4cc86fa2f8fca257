"""Build the project's C++ kernels for this machine, once: compiled with the machine's gcc on first use and
cached under the project's cache dir, keyed by the source, the flags and the torch version."""
from __future__ import annotations

import functools
import hashlib
import sys
import time
from pathlib import Path
from typing import Any

import torch

from data.models import cache_dir


def build_extension(name: str, source: Path, flags: list[str], includes: tuple[Path, ...] = ()) -> tuple[Any | None, str]:
    """(the extension module, "") or (None, why it did not build: said once on stderr). `includes`: the files
    `source` #includes, keyed with it."""
    from torch.utils import cpp_extension

    key = hashlib.sha256(b"".join(p.read_bytes() for p in (source, *includes)) + " ".join(flags + [torch.__version__]).encode()).hexdigest()[:12]
    build = cache_dir() / "kernels" / key
    build.mkdir(parents=True, exist_ok=True)
    lock = build / "lock"  # left behind by a build that was killed: torch would wait for it forever
    if lock.exists() and time.time() - lock.stat().st_mtime > 300:
        lock.unlink(missing_ok=True)
    started = time.perf_counter()
    try:
        module = cpp_extension.load(f"{name}_{key}", [str(source)], extra_cflags=flags,
                                    extra_ldflags=["-fopenmp"], build_directory=str(build))
    except Exception as err:  # no compiler, no ninja, no Python headers: the caller falls back, said once
        why = (str(err).strip().splitlines() or [type(err).__name__])[-1]
        print(f"decode: the {name} kernels did not build ({why[:200]}); using the fallback", file=sys.stderr)
        return None, why
    if time.perf_counter() - started > 5:
        print(f"decode: built the {name} kernels in {time.perf_counter() - started:.0f} s (cached in {build})", file=sys.stderr)
    return module, ""


@functools.cache
def avx2_kernel() -> tuple[Any | None, str]:
    """(kernels.cpp built for this machine: the packed fp32 product and `attend`, "") or (None, why not).
    gcc must be told -fopenmp: without it ATen's parallel_for compiles to a serial loop in an extension."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None, f"the CPU lacks AVX2+FMA ({torch.backends.cpu.get_cpu_capability()})"
    return build_extension("polyspec_kernels", Path(__file__).with_name("kernels.cpp"),
                           ["-O3", "-mavx2", "-mfma", "-fopenmp"])
