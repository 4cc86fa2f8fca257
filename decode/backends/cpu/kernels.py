"""Build the project's C++ kernels for this machine, once: compiled with the machine's gcc on first use and
cached under the project's cache dir, keyed by every source and header, the flags and the torch version.

The C++ is headers plus sources, one job each:
  simd.h               the one SIMD map: the build's vectors (AVX-512 or AVX2) and the fixed 8-lane helpers
  tiles.h              the tile driver every product shares (which tile computes which rows and panels)
  pack.h, pack.cpp     weight packing: fp32 panels, int4 codes (fp32 or int8 activations), int8 rows
  kernels.h, .cpp      the packed fp32 product, attention and the read-bandwidth probe
  kernels_module.cpp   their Python module (decode.fast): `avx2_kernel`
  quantized_tiles.h    the int4 and int8 tile products and the rows' int8 quantization
  packed_linear.h, .cpp  a PackedWeight of either kind and the product through it
  layers.h             the decoder's per-row layers: RMS norm, rotary, residual add, SiLU gate
  decoder.h, .cpp      the native decoder's forward over the caller's KV cache
  decoder_module.cpp   its Python module: decode.backends.cpu.llama's `native_kernels`"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from data.models import cache_dir

HERE = Path(__file__).parent
HEADERS = tuple(sorted(HERE.glob("*.h")))
FP32_SOURCES = (HERE / "kernels.cpp", HERE / "pack.cpp")  # what both extensions link


def build_folder(sources: tuple[Path, ...], flags: list[str]) -> Path:
    """Where `sources` build: keyed by the sources, every header beside them, the flags and torch's version."""
    text = b"".join(p.name.encode() + p.read_bytes() for p in (*sources, *HEADERS))
    key = hashlib.sha256(text + " ".join(flags + [torch.__version__]).encode()).hexdigest()[:12]
    return cache_dir() / "kernels" / key


@contextlib.contextmanager
def only_builder(build: Path) -> Iterator[None]:
    """Held while one process builds in `build`. The kernel frees a flock when its holder dies, unlike torch's own
    lock file, which a killed build leaves behind for every later one to wait on forever: under the flock, that
    file can only be such a leftover, and goes."""
    build.mkdir(parents=True, exist_ok=True)
    with open(build / "build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (build / "lock").unlink(missing_ok=True)
        yield


def build_extension(name: str, sources: tuple[Path, ...], flags: list[str]) -> tuple[Any | None, str]:
    """(the extension module of `sources`, "") or (None, why it did not build: said once on stderr)."""
    from torch.utils import cpp_extension

    build = build_folder(sources, flags)
    started = time.perf_counter()
    try:
        with only_builder(build):
            module = cpp_extension.load(f"{name}_{build.name}", [str(s) for s in sources], extra_cflags=flags,
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
    """(kernels.cpp built for this machine: `pack`, the packed fp32 product and `attend`, "") or (None, why not).
    gcc must be told -fopenmp: without it ATen's parallel_for compiles to a serial loop in an extension."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None, f"the CPU lacks AVX2+FMA ({torch.backends.cpu.get_cpu_capability()})"
    return build_extension("polyspec_kernels", (*FP32_SOURCES, HERE / "kernels_module.cpp"),
                           ["-O3", "-mavx2", "-mfma", "-fopenmp"])
