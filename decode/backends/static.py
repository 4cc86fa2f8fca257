"""The compiled static runners: the static-cache runner (decode.backends.cuda.runner) with its fixed-width forward under
`torch.compile(fullgraph=True, dynamic=False)`, on any device, so that a CPU test runs the code a GPU runs; and the
same for a draft head's step (CompiledHeadRunner: EAGLE-2 and EAGLE-3).

Every forward has one of a few shapes: it is cut into pieces of at most max(widths) tokens, each padded to the next
width, and attends over the whole buffer (the span of keys is fixed: the buffer holds max_length positions plus one
widest piece, so a padded piece always has slots to write). One compiled graph per width, then, and nothing that
changes from step to step reaches a guard: the slots and the mask are tensors, and the cache's length is never read
inside the compiled forward. Rollback moves the length pointer; stale keys past it are masked off like the padding's.

A runner compiles every width when it is made (its warm-up); every later forward of that width runs under
`torch.compiler.set_stance("fail_on_recompile")`: a guard that fails raises instead of silently recompiling in a
timed loop. On CUDA the compiled forward (a model's, a head's) is captured by hand as a CUDA graph per width
(decode.backends.cuda.runner.CapturedGraphs), not by `mode="reduce-overhead"`: its cudagraph trees would see the KV
buffer, written in place at every forward and between forwards (keep), as a mutated input that is not a parameter
and skip the graph (or copy the buffer), while the hand capture already replays from static buffers (checked on an
H200 for the eager forward)."""
from __future__ import annotations

import functools
import os
import types
import weakref
from typing import Callable

import torch
from transformers import PreTrainedModel
from transformers.utils.output_capturing import maybe_install_capturing_hooks

from data.models import cache_dir
from decode.backends.aoti import AheadOfTime
from decode.backends.cpu.attention import KERNEL_ATTENTION
from decode.backends.cuda import cuda_runners
from decode.backends.cuda.runner import (MAX_LENGTH, WIDTHS, CapturedGraphs, StaticKV, StaticRunner, decoder_forward,
                                        extend, key_length_of, kv_buffers, static_mask)
from decode.engine.errors import DecodeError
from decode.engine.runner import Runner


def dynamo_limits() -> dict[str, object]:
    """torch.compile's settings for the compiled runners only, set around their calls, never process-wide: another
    library's compiled code in the same process (GPTQModel's dequantization recompiles per module) keeps its own
    fallback. Enough compiled graphs for widths x levels x captures; past them, an error, never eager in silence."""
    config = torch._dynamo.config
    return {"fail_on_recompile_limit_hit": True, "recompile_limit": max(config.recompile_limit, 64),
            "accumulated_recompile_limit": max(config.accumulated_recompile_limit, 512)}


def compile_options(backend: str | Callable, device: torch.device) -> dict[str, object]:
    """The compile's options for the runners. On a CPU the project's operators are called through their C shims
    from C++: inductor's C++ wrapper (no Python between a forward's kernels) or AOTInductor's library (`aoti`, whose
    only options these are). torch.compile's guards on the module's own parameters, buffers and attributes are
    skipped (`compiled_for` gives each module entries of its own, so nothing else can match them): a forward's
    inputs are all that changes, and the module's hundreds of tensors were checked at every call."""
    shims: dict[str, object] = {}
    if device.type == "cpu":
        from decode.backends.cpu.kernels import c_shims
        shims = {"aot_inductor.custom_ops_to_c_shims": c_shims()}
    if backend == "aoti":
        return shims
    options: dict[str, object] = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    if backend == "inductor" and device.type == "cpu":
        options |= {"cpp_wrapper": True, **shims}
    return options


def use_project_cache() -> None:
    """Inductor's compiled code cached under the project's cache dir, unless TORCHINDUCTOR_CACHE_DIR names another
    folder: inductor sets that variable to its own default the first time anything asks it for its cache (some
    imports do), so its default is taken as unset."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, os.path.abspath(default_cache_dir())):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")


COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module: {(forward, backend): its compiled form}


def compiled_for(module: torch.nn.Module, forward: Callable, backend: str | Callable,
                 device: torch.device) -> Callable:
    """`forward` compiled for calls on `module` by `backend` (torch.compile's, or "aoti": decode.backends.aoti),
    shared by every runner of it (only the first compiles a width). Its
    compiled entries are its own: dynamo keeps them on a function's code object, and this is a copy of `forward`
    with a code object of its own, so that a runner of another module, whose guards on its module are skipped alike,
    can never run this one's graphs. Inductor's compiled code is cached on disk (`use_project_cache`): a later process
    loads it."""
    use_project_cache()
    per_module = COMPILED.setdefault(module, {})
    if (forward, backend) not in per_module:
        per_module[forward, backend] = compile_forward(forward, backend, device)
    return per_module[forward, backend]


def compile_forward(forward: Callable, backend: str | Callable, device: torch.device) -> Callable:
    """`forward` compiled by AOTInductor (`aoti`) or torch.compile's `backend`: a copy of `forward` with a code object
    of its own (see `compiled_for`)."""
    options = compile_options(backend, device)
    if backend == "aoti":
        return AheadOfTime(forward, options)
    own = types.FunctionType(forward.__code__.replace(), forward.__globals__, forward.__name__,
                             forward.__defaults__, forward.__closure__)
    return torch.compile(own, fullgraph=True, dynamic=False, backend=backend, options=options)


class Pieces:
    """What the compiled runners share: a forward cut into pieces of at most max(widths) tokens after the cached ones,
    each padded to the next width and run by `_run` (compiled) or `_replay` (a CUDA graph of it), under the
    no-recompile rule (`_call`). A user sets cache (a StaticKV), widths, max_length, dtype, device, graph_widths, warm,
    reads_prefix and compiled."""

    def _pieces(self, ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor | None,
                features: torch.Tensor | None = None) -> list[tuple[torch.Tensor | None, ...]]:
        width, cached, widest = ids.shape[1], self.cache.length, self.widths[-1]
        if cached + width > self.max_length:
            raise DecodeError(f"the static runner holds {self.max_length} positions: {cached} cached + {width} new do "
                              "not fit (a larger max_length, or a shorter prompt or max_new_tokens)")
        if positions is None:
            positions = torch.arange(cached, cached + width, device=self.device)[None]
        return [self._piece(ids[:, i: i + widest],  # no mask: causal, made for each piece
                            None if mask is None else mask[..., i: i + widest, : cached + i + widest],
                            positions[:, i: i + widest], None if features is None else features[:, i: i + widest])
                for i in range(0, width, widest)]

    def _piece(self, ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor,
               features: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """One forward of at most max(widths) tokens after the cached ones, padded to the next width."""
        width, cached = ids.shape[1], self.cache.length
        rows = next(w for w in self.widths if w >= width)
        slots = torch.arange(cached, cached + rows, device=self.device)
        # fresh inference tensors of plain strides at every call (guards check dispatch keys and strides)
        ids, positions = (x.clone(memory_format=torch.contiguous_format) for x in (ids, positions))
        positions = extend(positions, rows, 1)
        mask = static_mask(mask, cached, width, self.cache.max_length, self.dtype, rows).to(self.device)
        inputs = (extend(ids, rows, 0), positions, self._masks(mask, positions, cached), slots)
        if features is not None:  # padded with zeros, whose outputs are dropped
            inputs += (torch.cat([features, features.new_zeros(1, rows - width, features.shape[-1])], dim=1),)
        out = self._replay(inputs) if rows in self.graph_widths else self._run(*inputs)
        self.cache.length = cached + width
        return tuple(None if x is None else x[:, :width] for x in out)

    def _write_at(self, slots: torch.Tensor) -> None:
        """The cache's slots for a piece and, where the attention is the kernel's (`reads_prefix`), the keys written
        once it runs: the kernel reads no further."""
        self.cache.slots = slots
        self.cache.key_length = slots[-1:] + 1 if self.reads_prefix else None

    def _call(self, key: tuple[int, ...], *args: object) -> tuple[torch.Tensor | None, ...]:
        """The compiled forward: at a key's (width's) first call it compiles (the warm-up) under the runners' limits,
        at every later one a recompile is an error (the stance raises before any limit is read, so a warm call, the
        hot path, patches nothing else; an ahead-of-time library has no dynamo, so nothing to guard)."""
        if key in self.warm and isinstance(self.compiled, AheadOfTime):
            return self.compiled(*args)
        if key in self.warm:
            with torch.compiler.set_stance("fail_on_recompile"):
                return self.compiled(*args)
        with torch._dynamo.config.patch(dynamo_limits()):
            out = self.compiled(*args)
        self.warm.add(key)
        return out


class CompiledRunner(Pieces, StaticRunner):
    """The Runner protocol on a StaticKV whose every forward is a compiled graph of one of `widths` (CUDA: replayed
    from a captured CUDA graph). `backend`: torch.compile's (inductor; tests may pass a lighter one)."""

    def __init__(self, model: PreTrainedModel, widths: tuple[int, ...] | None = None, max_length: int | None = None,
                 graphs: bool = True, backend: str | Callable = "inductor"):
        super().__init__(model, widths, max_length, graphs)
        if not self.widths:
            raise ValueError("the compiled runner needs at least one width")
        self.use_cache(StaticKV(self.config, self.max_length + self.widths[-1]))
        self.cache.buffers = config_buffers(self.config, self.cache.max_length, self.dtype, self.device)
        self.warm: set[tuple[int, ...]] = set()
        maybe_install_capturing_hooks(self.decoder)  # transformers installs them at a first capture, under a lock
        self.compiled = compiled_for(self.decoder, decoder_forward, backend, self.device)
        self.reads_prefix = self.config._attn_implementation == KERNEL_ATTENTION
        self.warm_up()

    def warm_up(self) -> None:
        """Compile (and on CUDA capture) every width now, so that no compile ever runs in a timed loop (runners of
        one architecture share the compiled code: only the first one compiles). The warm-up's keys land past the
        cached ones, stale, and the length is put back."""
        self.warm.clear()
        length = self.cache.length
        for width in self.widths:
            self.forward(torch.zeros(1, width, dtype=torch.long, device=self.device), None, None)
            self.cache.length = length

    def capture(self, layers: tuple[int, ...]) -> None:
        super().capture(layers)
        self.warm_up()  # a forward that also returns features is another graph

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor | None) -> torch.Tensor:
        pieces = self._pieces(ids, mask, positions)
        if self.layers:
            self.captured = torch.cat([aux for _, aux in pieces], dim=1)
        return torch.cat([hidden for hidden, _ in pieces], dim=1)

    def _run(self, ids, positions, mask, slots) -> tuple[torch.Tensor, torch.Tensor | None]:
        self._write_at(slots)
        return self._call((ids.shape[1],), self.decoder, self.cache, ids, positions, mask, self.layers)


class HeadKV(StaticKV):
    """A draft head's StaticKV. Its length stays out of the compiled forward: the head reads get_seq_length only for
    the positions and mask its runner always gives, and a length read there would be guarded on (a recompile a
    step)."""

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def head_forward(head: torch.nn.Module, cache: StaticKV, ids: torch.Tensor, positions: torch.Tensor,
                 mask: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor]:
    """A draft head's (EAGLE-2's, EAGLE-3's) forward on a StaticKV (its slots set): the features its next step
    feeds back."""
    return head(ids, features, past_key_values=cache, position_ids=positions, attention_mask=mask,
                compute_logits=False, **key_length_of(cache))[:1]


class CompiledHeadRunner(Pieces, CapturedGraphs):
    """The HeadRunner protocol (decode.engine.runner) on a StaticKV: an EAGLE-2 or EAGLE-3 head's own forward
    compiled per width (and per feature size: an EAGLE-3 head's first step fuses the target's 3h aux states, its
    later ones take its own h), on CUDA replayed from a CUDA graph of each (unless `graphs` is False), as
    CompiledRunner's."""

    def __init__(self, head: torch.nn.Module, widths: tuple[int, ...] = WIDTHS, max_length: int = MAX_LENGTH,
                 backend: str | Callable = "inductor", graphs: bool = True):
        self.head, self.widths, self.max_length = head, tuple(sorted(widths)), max_length
        self.dtype, self.device = head.fc.weight.dtype, head.fc.weight.device
        self.graph_widths = self.widths if graphs and self.device.type == "cuda" else ()
        self._drop_graphs()
        self.cache = HeadKV(head.config, max_length + self.widths[-1])
        self.cache.buffers = config_buffers(head.config, self.cache.max_length, self.dtype, self.device)
        self.warm: set[tuple[int, ...]] = set()
        self.reads_prefix = head.config._attn_implementation == KERNEL_ATTENTION
        self.compiled = compiled_for(head, head_forward, backend, self.device)
        self.warm_up()

    def warm_up(self) -> None:
        """Compile every width for each feature size the head takes (its own h; an EAGLE-3 head's first step the
        target's aux states too) now, as CompiledRunner does: a compile in a chain's first draft would land in its
        timed forwards (a head step measured in seconds). The warm-up's keys are stale; the length is put back."""
        self.warm.clear()
        for width in self.widths:
            for size in dict.fromkeys((self.head.feature_size, self.head.config.hidden_size)):
                self.forward(torch.zeros(1, width, dtype=torch.long, device=self.device),
                             torch.zeros(1, width, size, dtype=self.dtype, device=self.device), None, None)
                self.cache.length = 0

    def reset(self) -> None:
        self.cache.length = 0

    def cached(self) -> int:
        return self.cache.length

    def crop(self, length: int) -> None:
        self.cache.length = min(self.cache.length, length)

    @staticmethod
    def _masks(mask: torch.Tensor, positions: torch.Tensor, cached: int) -> torch.Tensor:
        """A head's one layer attends over every key it holds: its mask as made."""
        return mask

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, features: torch.Tensor, mask: torch.Tensor | None,
                positions: torch.Tensor | None) -> torch.Tensor:
        return torch.cat([hidden for hidden, in self._pieces(ids, mask, positions, features)], dim=1)

    def _run(self, ids, positions, mask, slots, features) -> tuple[torch.Tensor]:
        self._write_at(slots)
        return self._call((ids.shape[1], features.shape[-1]), self.head, self.cache, ids, positions, mask, features)


def config_buffers(config, length: int, dtype: torch.dtype,
                   device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A StaticKV's buffers for a model of `config`, made before the first forward (buffers made inside the compiled
    one would change what its guards see)."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return kv_buffers(config.num_hidden_layers, heads, length, dim, dtype, device)


def static_runners(model: PreTrainedModel, widths: tuple[int, ...] | None = None, max_length: int | None = None,
                   backend: str = "inductor") -> Callable[[], Runner]:
    """New compiled static runners of `model` (compiled by `backend`), or HFRunners where the static runner cannot
    run it (said once, why)."""
    return cuda_runners(model, widths, max_length, functools.partial(CompiledRunner, backend=backend))
