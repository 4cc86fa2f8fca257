"""Memory in transparent huge pages, for what a forward streams: packed weights, and the read probe that measures
their floor (infra.timing).

A forward streams every packed weight once, a few hundred KiB per product. On 4 KiB pages each page costs a TLB miss
and the hardware prefetchers stop at every page boundary, so a cold product starts over every 4 KiB; in 2 MiB pages
the weights of a layer sit in a handful of pages, one after the other. Linux backs an anonymous mapping with huge
pages where it is advised (MADV_HUGEPAGE) and the system's mode is `always` or `madvise`; torch's allocator advises
nothing. So tensors are cut from chunks of such memory, side by side in the order they are made (a model's layers in
order), each 64-byte aligned. Where the system offers no transparent huge pages, torch allocates as usual. Placement
changes no bits: only where the bytes lie.
"""
from __future__ import annotations

import contextlib
import functools
import mmap
from pathlib import Path
from typing import Iterator

import torch

HUGE_PAGE = 2 << 20
CHUNK = 64 << 20  # a chunk's untouched pages cost no memory; a model's weights fill them in order
ALIGN = 64
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def available() -> bool:
    """Whether this system backs advised mappings with transparent huge pages (mode `always` or `madvise`) and
    takes the advice."""
    try:
        mode = THP_MODE.read_text()
        if not hasattr(mmap, "MADV_HUGEPAGE") or ("[always]" not in mode and "[madvise]" not in mode):
            return False
        with mmap.mmap(-1, HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as probe:
            probe.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        return False
    return True


class _Chunk:
    """One anonymous mapping advised for huge pages, handed out front to back. Every tensor cut from it holds the
    mapping (torch.frombuffer keeps its buffer alive), so it is unmapped when the last of them is freed."""

    def __init__(self, nbytes: int):
        self.map = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.map.madvise(mmap.MADV_HUGEPAGE)
        whole = torch.frombuffer(self.map, dtype=torch.uint8)
        start = -whole.data_ptr() % HUGE_PAGE
        self.bytes, self.used = whole[start:start + nbytes], 0

    def take(self, nbytes: int) -> torch.Tensor | None:
        """`nbytes` of the chunk, 64-byte aligned, or None where it has no room left."""
        start = -(-self.used // ALIGN) * ALIGN
        if start + nbytes > self.bytes.numel():
            return None
        self.used = start + nbytes
        return self.bytes[start:self.used]


_chunk: _Chunk | None = None
_small_pages = False


@contextlib.contextmanager
def small_pages() -> Iterator[None]:
    """Within it, tensors are allocated by torch as if the system offered no huge pages: the baseline a benchmark
    times beside them (decode.costs)."""
    global _small_pages
    before, _small_pages = _small_pages, True
    try:
        yield
    finally:
        _small_pages = before


def _room(nbytes: int) -> torch.Tensor:
    global _chunk
    room = _chunk.take(nbytes) if _chunk is not None else None
    if room is None:
        _chunk = _Chunk(max(CHUNK, -(-nbytes // HUGE_PAGE) * HUGE_PAGE))
        room = _chunk.take(nbytes)
    return room


def empty(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialized contiguous CPU tensor in memory advised for huge pages (torch's own where there are none)."""
    if _small_pages or not available():
        return torch.empty(shape, dtype=dtype)
    return _room(torch.Size(shape).numel() * dtype.itemsize).view(dtype).view(shape)


def in_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU tensor in memory advised for huge pages, or the tensor itself where the system
    offers none."""
    if _small_pages or not available() or tensor.device.type != "cpu" or tensor.numel() == 0:
        return tensor
    return empty(tuple(tensor.shape), tensor.dtype).copy_(tensor)


def mode() -> str:
    """What a timing's reader needs to know of the pages: `2 MiB` where tensors are placed in huge pages, else
    `4 KiB`."""
    return "2 MiB" if available() else "4 KiB"
