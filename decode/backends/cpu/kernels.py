"""Build the project's C++ kernels for this machine, once: compiled with the machine's gcc on first use and
cached under the project's cache dir, keyed by every source and header, the flags and the torch version.

The C++ is headers plus sources, one job each:
  simd.h               the one SIMD map: the build's vectors (AVX-512 or AVX2) and the fixed 8-lane helpers
  tiles.h              the tile driver every product shares (which tile computes which rows and panels)
  pack.h, pack.cpp     weight packing: fp32 panels, int4 codes (fp32 or int8 activations), int8 rows
  kernels.h, .cpp      the packed fp32 product, attention and the read-bandwidth probe
  quantized_tiles.h    the int4 and int8 tile products and the rows' int8 quantization
  packed_linear.h, .cpp  a PackedWeight of either kind and the product through it
  ops.cpp              all of them as torch operators, torch.ops.polyspec (`kernel_ops`)
  layers.h             the decoder's per-row layers: RMS norm, rotary, residual add, SiLU gate
  decoder.h, .cpp      the native decoder's forward over the caller's KV cache
  decoder_module.cpp   its Python module: decode.backends.cpu.llama's `native_kernels`"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from data.models import cache_dir

HERE = Path(__file__).parent
HEADERS = tuple(sorted(HERE.glob("*.h")))
KERNEL_SOURCES = (HERE / "kernels.cpp", HERE / "pack.cpp", HERE / "packed_linear.cpp")  # what both builds link


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


def build_extension(name: str, sources: tuple[Path, ...], flags: list[str],
                    python_module: bool = True) -> tuple[Any | None, str]:
    """(the extension module of `sources`, "") or (None, why it did not build: said once on stderr); a build that
    only registers torch operators (`python_module` False) is loaded into the process and gives its library's path."""
    from torch.utils import cpp_extension

    build = build_folder(sources, flags)
    started = time.perf_counter()
    try:
        with only_builder(build):
            module = cpp_extension.load(f"{name}_{build.name}", [str(s) for s in sources], extra_cflags=flags,
                                        extra_ldflags=["-fopenmp"], build_directory=str(build),
                                        is_python_module=python_module)
    except Exception as err:  # no compiler, no ninja, no Python headers: the caller falls back, said once
        why = (str(err).strip().splitlines() or [type(err).__name__])[-1]
        print(f"decode: the {name} kernels did not build ({why[:200]}); using the fallback", file=sys.stderr)
        return None, why
    if time.perf_counter() - started > 5:
        print(f"decode: built the {name} kernels in {time.perf_counter() - started:.0f} s (cached in {build})",
              file=sys.stderr)
    return module, ""


def has_avx512_vnni() -> bool:
    """Whether torch runs AVX-512 here (not forced down to AVX2) and the CPU has its BW and VNNI parts."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return torch.backends.cpu.get_cpu_capability() == "AVX512" and {"avx512bw", "avx512_vnni"} <= set(flags)


def build_flags() -> list[str]:
    """AVX-512 where the CPU has its BW and VNNI parts, else AVX2; gcc must be told -fopenmp: without it ATen's
    parallel_for compiles to a serial loop in an extension."""
    wide = ["-mavx512f", "-mavx512bw", "-mavx512vnni"] if has_avx512_vnni() else []
    return ["-O3", "-mavx2", "-mfma", "-fopenmp", *wide]


@functools.cache
def kernel_ops() -> tuple[Any | None, str]:
    """(torch.ops.polyspec: the kernels as torch operators, built for this machine, "") or (None, why not)."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None, f"the CPU lacks AVX2+FMA ({torch.backends.cpu.get_cpu_capability()})"
    library, why = build_extension("polyspec_ops", (*KERNEL_SOURCES, HERE / "ops.cpp"), build_flags(),
                                   python_module=False)
    if library is None:
        return None, why
    ctypes.CDLL(library, mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD)  # its C shims visible to inductor's compiled wrappers
    _register_fakes()
    return torch.ops.polyspec, ""


C_SHIMS = {  # operator: the C function ops.cpp gives inductor's C++ wrapper to call it by
    "linear": "aoti_torch_cpu_linear(AtenTensorHandle, AtenTensorHandle, int64_t, AtenTensorHandle*, "
              "AtenTensorHandle*)",
    "packed_linear": "aoti_torch_cpu_packed_linear(AtenTensorHandle, AtenTensorHandle, int64_t, AtenTensorHandle*, "
                     "AtenTensorHandle*, AtenTensorHandle*, AtenTensorHandle*, AtenTensorHandle*)",
    "attend": "aoti_torch_cpu_attend(AtenTensorHandle, AtenTensorHandle, AtenTensorHandle, AtenTensorHandle*, double, "
              "int32_t, AtenTensorHandle*, double, AtenTensorHandle*)",
}


def c_shims() -> dict[Any, list[str]]:
    """inductor's `aot_inductor.custom_ops_to_c_shims` for the built operators (none when they did not build)."""
    ops, _ = kernel_ops()
    if ops is None:
        return {}
    return {getattr(ops, name).default: [f"AOTITorchError {shim}"] for name, shim in C_SHIMS.items()}


def _register_fakes() -> None:
    """The operators' output shapes without running them, for tracing (torch.compile)."""
    def linear(x, panels, n, bias=None):
        return x.new_empty(x.shape[0], n)

    def packed_linear(x, words, n, *parts):
        return x.new_empty(*x.shape[:-1], n)

    def attend(q, *rest):
        return q.new_empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3])

    for name, fake in (("linear", linear), ("packed_linear", packed_linear), ("attend", attend)):
        torch.library.register_fake(f"polyspec::{name}", fake)
