"""Side-by-side timing: median milliseconds of several forwards, interleaved so machine noise hits all alike."""
from __future__ import annotations

import statistics
import time
from typing import Callable

from infra.device import synchronized_clock

Step = Callable[[int], object]  # one forward of k new tokens on a fixed context


def median_ms(steps: dict[str, Step], ks: list[int], repeats: int, warmup: int = 2) -> dict[str, dict[int, float]]:
    """{name: {k: median ms}}: for each repeat and each k, every step runs once in turn (order rotating)."""
    names = list(steps)
    times: dict[str, dict[int, list[float]]] = {name: {k: [] for k in ks} for name in names}
    for r in range(warmup + repeats):
        for k in ks:
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                start = synchronized_clock()
                steps[name](k)
                if r >= warmup:
                    times[name][k].append((synchronized_clock() - start) * 1000)
    return {name: {k: statistics.median(ts) for k, ts in per.items()} for name, per in times.items()}


def cached_forward(model, context: list[int]) -> Step:
    """A step for `median_ms`: one forward of k new tokens of a causal LM on top of a KV cache of `context`
    (computed once; each call first crops the cache back to it) with all k logits, as a verification does."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = torch.tensor([context], device=model.device)
    with torch.inference_mode():
        model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)

    def step(k: int) -> object:
        extra = cache.get_seq_length() - len(context)
        if extra:
            cache.crop(-extra)
        with torch.inference_mode():
            return model(ids[:, -k:], past_key_values=cache, use_cache=True, logits_to_keep=k)

    return step


def level_forward(level, context: list[int]) -> Step:
    """A step: one verification-shaped forward of k new tokens through a decode model level (its runner and LM
    head, as a chain runs it) after a cached context."""
    import torch

    with torch.inference_mode():
        level.forward(context, 1, "verify")

    def step(k: int) -> object:
        level.tokens = level.tokens[: len(context)]  # the last step's tokens are not a prefix to keep
        with torch.inference_mode():
            return level.forward(context + context[-k:], k, "verify")

    return step


def times_table(times: dict[str, dict[int, float]], base: str, label: str) -> list[str]:
    """One line per row of `median_ms`'s result: ms at each k, its ratio to row `base` (called `label`), and the
    row's T(largest k) / T(smallest k)."""
    width = max(map(len, times)) + 2
    lines = []
    for name, per in times.items():
        ks = sorted(per)
        cells = "  ".join(f"k={k}: {per[k]:6.2f} ms ({per[k] / times[base][k]:.3f}x {label})" for k in ks)
        lines.append(f"{name:{width}s}{cells}  T({ks[-1]})/T({ks[0]}) {per[ks[-1]] / per[ks[0]]:.2f}")
    return lines


def read_bandwidth(gib: float = 1.0, repeats: int = 7) -> float:
    """Bytes per second of a plain large-array read (torch's sum over an array far larger than the caches), on the
    threads torch runs with: what a memory-bound forward can stream at best."""
    import torch

    data = torch.ones(int(gib * 2**30) // 4)
    data.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - start)
    return data.numel() * 4 / statistics.median(times)


def weight_bytes(model) -> int:
    """The bytes a one-token forward of a causal LM streams: every parameter but the input embedding (one row of it
    is read), the LM head counted once whether or not it is tied."""
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    unique = {id(p): p for p in model.parameters()}
    unique.pop(id(embedding), None)
    unique[id(head)] = head
    return sum(p.numel() * p.element_size() for p in unique.values())


def streaming_floor_ms(model) -> tuple[float, int, float]:
    """(ms, bytes, bytes per second): the weight-streaming floor of one forward, measured here and now."""
    bandwidth, size = read_bandwidth(), weight_bytes(model)
    return size / bandwidth * 1000, size, bandwidth
