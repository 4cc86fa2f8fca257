"""Side-by-side timing: median milliseconds of several forwards, interleaved so machine noise hits all alike."""
from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from infra.device import synchronized_clock

Step = Callable[[int], object]  # one forward of k new tokens on a fixed context


def median_ms(steps: dict[str, Step], ks: list[int], repeats: int, warmup: int = 2) -> dict[str, dict[int, float]]:
    """{name: {k: median ms}} of `interleaved_ms`."""
    return medians(interleaved_ms(steps, ks, repeats, warmup))


def medians(times: dict[str, dict[int, list[float]]]) -> dict[str, dict[int, float]]:
    """{name: {k: median ms}} of `interleaved_ms`'s per-repeat times."""
    return {name: {k: statistics.median(ts) for k, ts in per.items()} for name, per in times.items()}


def interleaved_ms(steps: dict[str, Step], ks: list[int], repeats: int,
                   warmup: int = 2) -> dict[str, dict[int, list[float]]]:
    """{name: {k: ms of each repeat}}: for each repeat and each k, every step runs once in turn (order rotating)."""
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
    return times


PRODUCT = re.compile(r"mm|gemv|linear|matmul", re.IGNORECASE)  # aten's (add/b)mm, int4pack_mm, matmul, linear; gemm


def launches(step: Step, device: Any) -> dict[str, int]:
    """What one forward of one new token (`step(1)`, run before it once) launches, by torch.profiler: `kernels`, on
    CUDA its device kernels and copies (CUPTI, inside a replayed CUDA graph too), on a CPU the operators it
    dispatches (a compiled graph's: the operators it calls, not the loops inductor generated), each counted once at
    its outermost (aten::linear, not also its aten::mm); `products`, how many of those are matrix products."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    step(1)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        step(1)
        synchronized_clock(device)
    events = prof.events()
    if cuda:
        names = [e.name for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    else:
        names = [e.name for e in events if _operator(e) and not _under_operator(e)]
    products = [name for name in names if PRODUCT.search(name)]
    return {"kernels": len(names), "products": len(products)}


def _operator(event: Any) -> bool:
    """An operator: aten's, MKL's, the project's kernels'."""
    return event.name.startswith(("aten::", "mkl::", "polyspec::"))


def _under_operator(event: Any) -> bool:
    """Whether a profiled event runs inside an operator (aten::mm inside aten::linear): counted once, outermost."""
    parent = event.cpu_parent
    while parent is not None and not _operator(parent):
        parent = parent.cpu_parent
    return parent is not None


@dataclass(frozen=True)
class CountedStep:
    """A step and the bytes its one-token forward streams, counted from the buffers it runs on once its context is
    cached (weights, LM head, KV cache): what its floor is computed from (`floors`)."""

    run: Step
    streamed_bytes: int

    def __call__(self, k: int) -> object:
        return self.run(k)


def cached_forward(model, context: list[int]) -> CountedStep:
    """A step for `median_ms`: one forward of k new tokens of a causal LM on top of a KV cache of `context`
    (computed once; each call first crops the cache back to it) with all k logits, as a verification does. The cache
    keeps every key and value of every layer, as the decode runners' do: a sliding-window layer built from the
    config evicts what its window passed and cannot be cropped back past it."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    ids = torch.tensor([context], device=model.device)
    with torch.inference_mode():
        model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)

    def step(k: int) -> object:
        extra = cache.get_seq_length() - len(context)
        if extra:
            cache.crop(-extra)
        with torch.inference_mode():
            return model(ids[:, -k:], past_key_values=cache, use_cache=True, logits_to_keep=k)

    return CountedStep(step, weight_bytes(model) + cache_bytes(cache))


def level_forward(level, context: list[int]) -> CountedStep:
    """A step: one verification-shaped forward of k new tokens through a decode model level (its runner and LM
    head, as a chain runs it) after a cached context."""
    import torch

    with torch.inference_mode():
        level.forward(context, 1, "verify")

    def step(k: int) -> object:
        level.tokens = level.tokens[: len(context)]  # the last step's tokens are not a prefix to keep
        with torch.inference_mode():
            return level.forward(context + context[-k:], k, "verify")

    return CountedStep(step, level_bytes(level))


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


class Bandwidth(NamedTuple):
    """A read bandwidth and how it was measured."""

    bytes_per_s: float
    method: str


def read_bandwidth(gib: float = 1.0, repeats: int = 7,
                   stream: tuple[Callable[[Any], float] | None, str] = (None, "")) -> Bandwidth:
    """The bytes per second a memory-bound forward can stream at best, on the threads torch runs with, over an array
    far larger than the caches. `stream`: (a kernel reading a float32 tensor once the way a good kernel does, all
    threads and wide loads, e.g. decode.backends.cpu.llama.stream_kernel(); its name), timed best of `repeats` as
    STREAM reports; without one, torch's sum, median of `repeats` (below what engines are seen to stream)."""
    from infra import hugepages

    kernel, name = stream
    data = _read_buffer(int(gib * 2**30))
    read = kernel or (lambda t: t.sum())
    read(data)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        read(data)
        times.append(time.perf_counter() - start)
    if kernel is None:
        return Bandwidth(data.nbytes / statistics.median(times), f"torch.sum, {hugepages.mode()} pages, median of "
                                                               f"{repeats}")
    return Bandwidth(data.nbytes / min(times), f"{name}, {hugepages.mode()} pages, best of {repeats}")


def _read_buffer(nbytes: int) -> Any:
    """A float32 buffer to read, in the pages packed weights lie in (infra.hugepages), written so that every page is
    mapped (no shared zero page to read)."""
    from infra import hugepages

    return hugepages.empty((nbytes // 4,)).fill_(1.0)


class ReadProbe:
    """A step timed among the forwards (`interleaved_ms`): one STREAM-style read (`stream`: kernel, name; torch's sum
    without one) of the next `window` bytes of a buffer far past the caches. Its median is the read bandwidth of the
    moments the forwards ran in: on a shared host it drifts by tens of percent from second to second, and a best-of
    read taken apart puts the floor in the best of those moments while a forward's median sits in a typical one."""

    def __init__(self, stream: tuple[Callable[[Any], float] | None, str], window: int = 2**28, total: int = 2**30):
        from infra import hugepages

        kernel, name = stream
        self.kernel = kernel or (lambda t: t.sum())
        self.name = f"{name if kernel is not None else 'torch.sum'}, {hugepages.mode()} pages"
        self.data = _read_buffer(total)
        self.window_bytes, self.at = window, 0

    def __call__(self, k: int) -> object:
        chunk = self.data[self.at: self.at + self.window_bytes // 4]
        self.at = (self.at + self.window_bytes // 4) % self.data.numel()
        return self.kernel(chunk)

    def bandwidth(self, times: dict[int, float]) -> Bandwidth:
        """The read bandwidth from this probe's row of `median_ms`'s result (the median over its ks)."""
        return Bandwidth(self.window_bytes / statistics.median(times.values()) * 1000,
                         f"{self.name}, median interleaved with the forwards")

    def paired_ratios(self, times: dict[str, dict[int, list[float]]], steps: dict[str, Step],
                      name: str) -> dict[str, float]:
        """Per step that counts its bytes, from `interleaved_ms`'s result (`times`, this probe's row `name` among them):
        the median over repeats of its T(1) against its floor at this probe's read in the same repeat (the moments a
        shared host's bandwidth holds for last about a second; a repeat's forwards and read share one)."""
        first = min(times[name])
        reads = times[name][first]
        ratios = {}
        for row, step in steps.items():
            size = getattr(step, "streamed_bytes", None)
            if size is not None:
                ratios[row] = statistics.median(t * self.window_bytes / (size * read)
                                                for t, read in zip(times[row][first], reads))
        return ratios


def module_bytes(module, skip: tuple = ()) -> int:
    """The bytes one forward of `module` reads whole: a module that says what it streams (`streamed_bytes()`: a
    packed weight's own buffers, not the original it keeps attached) counts that, any other its own parameters and
    buffers; each module and tensor once, the modules in `skip` (and theirs) not at all."""
    seen = {id(m) for m in skip}

    def visit(sub) -> int:
        if id(sub) in seen:
            return 0
        seen.add(id(sub))
        if hasattr(sub, "streamed_bytes"):
            return sub.streamed_bytes()
        own = [t for t in (*sub.parameters(recurse=False), *sub.buffers(recurse=False)) if id(t) not in seen]
        seen.update(id(t) for t in own)
        return sum(t.nbytes for t in own) + sum(visit(child) for child in sub.children())

    return visit(module)


def weight_bytes(model, lm_head=None) -> int:
    """The bytes of the weights a one-token forward of a causal LM streams, as it runs them (packed where packed):
    every module's but the input embedding's (one row of it is read), and the LM head (`lm_head`, else the model's
    own) once, whether or not it is tied."""
    embedding, own_head = model.get_input_embeddings(), model.get_output_embeddings()
    return module_bytes(model, skip=(embedding, own_head)) + module_bytes(own_head if lm_head is None else lm_head)


def cache_bytes(cache) -> int:
    """The bytes of the keys and values a KV cache (transformers' Cache) holds for its cached positions: what the
    next forward's attention reads."""
    if cache is None:
        return 0
    length, total = cache.get_seq_length(), 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if t is not None and t.dim() >= 2 and t.shape[-2]:
                total += t.nbytes // t.shape[-2] * min(length, t.shape[-2])
    return total


def forward_bytes(runner, lm_head, weights: int) -> int:
    """The bytes one one-token forward through `runner` streams now: the runner's own count where it keeps one (the
    native runners: the buffers they run on and their KV caches) and `lm_head` as it runs (a vocabulary's rows, int8,
    packed); else `weights` (the caller's count of the weights it reads, that LM head included) and its KV cache."""
    if hasattr(runner, "streamed_bytes"):
        return runner.streamed_bytes() + module_bytes(lm_head)
    return weights + cache_bytes(getattr(runner, "cache", None))


def level_bytes(level) -> int:
    """The bytes a one-token forward of a decode model level streams now (forward_bytes; its model's weights as
    weight_bytes counts them with the level's LM head)."""
    return forward_bytes(level.runner, level.lm_head, weight_bytes(level.model, level.lm_head))


def floors(times: dict[str, dict[int, float]], steps: dict[str, Step], bandwidth: Bandwidth) -> dict[str, dict]:
    """Per row of `median_ms`'s result whose step counts its bytes (`CountedStep`): its floor (those bytes over the
    read bandwidth, in ms), T(1) / floor and T(k) / T(1) for each k (1: the row's smallest k)."""
    rows = {}
    for name, per in times.items():
        size = getattr(steps[name], "streamed_bytes", None)
        if size is None:
            continue
        ms, first = size / bandwidth.bytes_per_s * 1000, per[min(per)]
        rows[name] = {"ms": ms, "bytes": size, "read_bytes_per_s": bandwidth.bytes_per_s, "method": bandwidth.method,
                      "ratio": first / ms, "t_k_over_t_1": {k: t / first for k, t in per.items()}}
    return rows
