"""Draft vocabularies: the N tokens a drafter may propose, chosen by frequency in the assistant replies.

A chat model's replies use a small part of its vocabulary: on the bundled SmolLM2 and ShareGPT, a few
thousand of the 49,152 tokens cover nearly every reply token. Restricting the drafter's LM head to
them cuts its largest cost; the target still verifies over the full vocabulary, so nothing is lost.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable

import torch


def assistant_token_counts(conversations: Iterable[tuple[list[int], list[int]]]) -> Counter:
    """Token counts over the assistant positions of (input_ids, loss_mask) pairs."""
    counts: Counter = Counter()
    for ids, mask in conversations:
        counts.update(t for t, m in zip(ids, mask) if m)
    return counts


def top_tokens(counts: Counter, n: int, vocab_size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """Sorted ids of the n most frequent tokens (ties by id), plus `always` (e.g. EOS), within [0, vocab_size)."""
    keep = {t for t in always if 0 <= t < vocab_size}
    for token, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(keep) >= n:
            break
        if 0 <= token < vocab_size:
            keep.add(token)
    return torch.tensor(sorted(keep), dtype=torch.long)


def coverage(counts: Counter, vocab: torch.Tensor) -> float:
    """Fraction of the counted tokens that fall inside `vocab`."""
    total = sum(counts.values())
    inside = set(vocab.tolist())
    return sum(c for t, c in counts.items() if t in inside) / total if total else 0.0
