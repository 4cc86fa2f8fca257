"""infra.timing's weight-streaming floor: the bytes a one-token forward must read, and the read bandwidth."""
from __future__ import annotations

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


def test_the_floor_is_the_weights_over_the_bandwidth(tiny_llama):
    ms, size, bandwidth = streaming_floor_ms(tiny_llama)
    assert size == weight_bytes(tiny_llama) and 1e8 < bandwidth < 1e13  # 0.1 GB/s .. 10 TB/s: a real measurement
    assert ms == size / bandwidth * 1000
    assert 1e8 < read_bandwidth(gib=0.125, repeats=3) < 1e13
