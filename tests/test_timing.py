"""infra.timing's weight-streaming floor: the bytes a one-token forward must read, and the read bandwidth."""
from __future__ import annotations

import statistics
import time

import torch

from infra.timing import read_bandwidth, streaming_floor_ms, weight_bytes


def _bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_a_tied_lm_head_is_streamed_once(tiny_llama):
    """Tied: the embedding matrix is the LM head, read whole once (the embedding lookup reads one row)."""
    assert tiny_llama.get_input_embeddings().weight is tiny_llama.get_output_embeddings().weight
    assert weight_bytes(tiny_llama) == _bytes(*tiny_llama.parameters())


def test_an_untied_embedding_is_not_streamed(tiny_llama):
    tiny_llama.lm_head.weight = torch.nn.Parameter(tiny_llama.lm_head.weight.detach().clone())
    embedding = tiny_llama.get_input_embeddings().weight
    assert weight_bytes(tiny_llama) == _bytes(*tiny_llama.parameters()) - _bytes(embedding)


def copy_read_rate(gib: float = 0.125, repeats: int = 3) -> float:
    """A second measurement of the memory system: bytes read per second by a large-array copy, timed here."""
    src = torch.ones(int(gib * 2**30) // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return src.numel() * 4 / statistics.median(times)


def test_the_floor_is_the_weights_over_the_bandwidth(tiny_llama):
    ms, size, bandwidth = streaming_floor_ms(tiny_llama)
    assert size == weight_bytes(tiny_llama) and ms == size / bandwidth * 1000


def test_the_read_bandwidth_agrees_with_a_copy_measured_beside_it():
    """A copy reads the same bytes while writing as many (and reading them first, for write-allocate), so a pure
    read streams between about as fast and three times as fast (1.5-1.8x on the 2-core EPYC); slack for noise.
    A wrong byte count (elements, bits), unit or timing parts them by 4x or more."""
    ratios = [read_bandwidth(gib=0.125, repeats=3) / copy_read_rate() for _ in range(2)]
    assert 0.75 < sorted(ratios)[-1] and sorted(ratios)[0] < 4, ratios
