"""A Runner on a static KV cache whose forwards replay CUDA graphs, for any transformers causal LM with full attention.

The cache is one preallocated buffer; its length is a pointer, so a rollback (`crop`) only moves the pointer and the
keys past it stay in place, stale. Every forward therefore gets an explicit additive mask over the attention span (the
first `span` positions, a power of two: the keys a forward reads grow with the context, not with max_length): causal
(or the engine's tree mask) over the valid positions, the dtype's minimum over everything else. A forward of up to
max(widths) tokens is padded to the next graph width (the padding's keys land past the valid positions, masked like
any stale ones, and its outputs are dropped), so that with shapes fixed per (width, span) the decoder's forward is
captured once as a CUDA graph (at its first use, after a warm-up on a side stream) and replayed from static input
buffers; wider forwards, and every forward off CUDA, run the same computation eagerly."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from decode.backends.int4pack import is_int4pack
from decode.engine.errors import DecodeError
from decode.engine.runner import attention_windows, names_layer_types, window_masks

WIDTHS = (1, 2, 4, 8, 16)  # token widths captured as graphs: a token, chain drafts and verifications, small trees
MAX_LENGTH = 4096  # positions the cache holds by default (at most the model's context)
MIN_SPAN = 64  # the smallest attention span
WARMUP = 2  # eager forwards on a side stream before a capture


def unsupported(model: PreTrainedModel) -> str | None:
    """Why the static runner cannot run `model`, or None: it masks full and sliding-window layers only, its graphs
    need forwards without host syncs (no dynamic rotary scaling) and it leaves quantized kernels to HF's forward, but
    for torch's own int4 kernel (decode.backends.int4pack: one aten call a linear, no host sync) and the project's CPU
    int4 tiles (decode.backends.cpu.kernel_linear: one operator a linear)."""
    config = model.config
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"} and attention_windows(config) is None:
        return f"layer types {sorted(kinds)}: only full and sliding-window attention"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(rope, dict) and ("dynamic" in str(rope.get("rope_type")) or rope.get("rope_type") == "longrope"):
        return f"{rope['rope_type']} rotary scaling (computed from the sequence)"
    if quantized_experts(model):
        return "a quantized model's routed experts (a loop over the experts a batch routes to: data-dependent)"
    if getattr(config, "quantization_config", None) is not None and not (is_int4pack(model) or on_kernels(model)):
        return "quantized weights (their kernels' graph capture is unchecked)"
    return None


def quantized_experts(model: torch.nn.Module) -> bool:
    """Whether `model` is quantized and routes tokens through experts (their quantized linears one module each,
    run in a loop over the experts routed to, which no graph captures)."""
    from heads.eagle import routes_to_experts

    return getattr(model.config, "quantization_config", None) is not None and routes_to_experts(model)


def on_kernels(model: torch.nn.Module) -> bool:
    """Whether every quantized linear of `model` runs the project's CPU int4 tiles (KernelLinear)."""
    from decode.backends.cpu.kernel_linear import KernelLinear, is_cpu_int4

    modules = list(model.modules())
    return any(isinstance(m, KernelLinear) for m in modules) and not any(is_cpu_int4(m) for m in modules)


def span_for(needed: int, max_length: int) -> int:
    """The attention span of a forward that needs `needed` positions: the next power of two (at least MIN_SPAN)."""
    return min(max_length, max(MIN_SPAN, 1 << (needed - 1).bit_length()))


def static_mask(mask: torch.Tensor | None, cached: int, width: int, span: int, dtype: torch.dtype,
                rows: int | None = None) -> torch.Tensor:
    """The additive mask [1, 1, rows (default width), span] of a forward of `width` tokens after `cached` positions:
    `mask` (the engine's, [1, 1, width, cached + width]; None = causal) over the valid positions, the minimum past
    them, where stale keys may lie; padding rows past `width` are causal (their outputs are dropped)."""
    rows = rows or width
    device = "cpu" if mask is None else mask.device
    full = torch.full((1, 1, rows, span), torch.finfo(dtype).min, dtype=dtype, device=device)
    causal = torch.ones(rows, cached + rows, dtype=torch.bool, device=device).tril(cached)
    full[0, 0, :, : cached + rows].masked_fill_(causal, 0)
    if mask is not None:
        full[..., :width, : cached + width] = mask
    return full


def extend(x: torch.Tensor, rows: int, step: int) -> torch.Tensor:
    """x [1, w] padded to [1, rows]: its last value plus `step` per padding position (ids: 0, positions: 1)."""
    extra = rows - x.shape[1]
    if extra == 0:
        return x
    return torch.cat([x, x[:, -1:] + step * torch.arange(1, extra + 1, device=x.device)], dim=1)


class StaticKV(DynamicCache):
    """Every layer's keys and values in buffers of their own [1, kv_heads, max_length, head_dim] (`buffers`: a
    (keys, values) pair a layer), allocated at the first write (from the keys' shape) unless made before. Not one
    buffer for all: a compiled forward writing a view of its input cannot write it in place, and copies the whole
    buffer at every layer's write instead (BENCHMARKS.md). A forward writes its keys at `slots` (a
    device tensor, so that a graph replays with new ones) and its attention reads the first `span` positions; `length`
    is the pointer. A DynamicCache for the rest of transformers' cache API (its layers stay empty: the runner always
    passes positions and a 4D mask)."""

    def __init__(self, config, max_length: int):
        super().__init__(config=config)
        self.max_length, self.layer_count, self.length = max_length, config.num_hidden_layers, 0
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.slots: torch.Tensor | None = None
        self.key_length: torch.Tensor | None = None  # [1]: the keys written, for an attention that reads only those
        self.span = max_length
        self.mask_types: tuple[str, ...] | None = None  # what each mask of a stack is for (sliding-window models)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.buffers is None:
            _, heads, _, dim = key_states.shape
            self.buffers = kv_buffers(self.layer_count, heads, self.max_length, dim, key_states.dtype,
                                      key_states.device)
        keys, values = self.buffers[layer_idx]
        keys.index_copy_(2, self.slots, key_states)
        values.index_copy_(2, self.slots, value_states)
        return keys[:, :, : self.span], values[:, :, : self.span]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length


def kv_buffers(layers: int, heads: int, length: int, dim: int, dtype: torch.dtype,
               device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A StaticKV's buffers: keys and values [1, heads, length, dim] for each of `layers` layers."""
    return [tuple(torch.zeros(1, heads, length, dim, dtype=dtype, device=device) for _ in range(2))
            for _ in range(layers)]


def key_length_of(cache: StaticKV) -> dict[str, torch.Tensor]:
    """The attention's keyword for a cache that knows how many of its keys are written (none for one that does not):
    an attention that reads only those is told so."""
    return {} if cache.key_length is None else {"key_length": cache.key_length}


def decoder_forward(decoder: torch.nn.Module, cache: StaticKV, ids: torch.Tensor, positions: torch.Tensor,
                    mask: torch.Tensor, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A decoder's forward on a StaticKV (its slots and span set): the last hidden states, and those entering
    `layers` side by side (None for no layers). One function: the compiled runner compiles what this one runs.
    A cache that knows how many of its keys are written (`key_length`) tells the attention, which may read only
    those; one whose layers differ in window (`mask_types`) takes a stack of masks, one a type."""
    extra = key_length_of(cache)
    masks = mask if cache.mask_types is None else dict(zip(cache.mask_types, mask.split(1), strict=True))
    out = decoder(input_ids=ids, attention_mask=masks, position_ids=positions, past_key_values=cache, use_cache=True,
                  output_hidden_states=bool(layers), **extra)
    aux = torch.cat([out.hidden_states[i] for i in layers], dim=-1) if layers else None
    return out.last_hidden_state, aux


@dataclass
class Graph:
    """A captured forward: its static inputs (ids, positions, mask, slots[, features]) and outputs (a model's hidden
    and captured states or None; a head's features)."""

    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor | None, ...]


class CapturedGraphs:
    """Forwards of a static cache replayed from CUDA graphs, one per shape of their inputs, captured at first use
    around the runner's `_run` (eager or compiled). A user sets device and graph_widths and calls _drop_graphs."""

    def _drop_graphs(self) -> None:
        """Forget every graph, and their memory pool with them: a pool whose graphs are all freed cannot take a new
        capture (PyTorch asserts), so the next capture starts a new one."""
        self.graphs: dict[tuple, Graph] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.graph_widths else None

    def _replay(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor | None, ...]:
        key = tuple(tuple(x.shape) for x in inputs)
        graph = self.graphs.get(key) or self._capture(key, inputs)
        for static, value in zip(graph.inputs, inputs):
            static.copy_(value)
        graph.graph.replay()
        return tuple(None if x is None else x.clone() for x in graph.outputs)

    def _capture(self, key: tuple, inputs: tuple[torch.Tensor, ...]) -> Graph:
        """Capture the forward of one shape on this forward's inputs: the warm-up runs it for real, which only writes
        this forward's keys at its own slots (the replay then writes the same ones again)."""
        static = tuple(x.clone() for x in inputs)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP):
                self._run(*static)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = self._run(*static)
        self.graphs[key] = Graph(graph, static, outputs)
        return self.graphs[key]


class StaticRunner(CapturedGraphs):
    """The Runner protocol (decode.engine.runner) on a StaticKV: crop moves the pointer, keep gathers the kept
    positions to the front, forwards padded to `widths` replay CUDA graphs on CUDA (eager elsewhere)."""

    def __init__(self, model: PreTrainedModel, widths: tuple[int, ...] | None = None, max_length: int | None = None,
                 graphs: bool = True):
        """Forwards are padded to `widths` (None: those of WIDTHS the cache holds; () = no padding), which replay
        CUDA graphs on CUDA unless `graphs` is False; the cache holds `max_length` positions (None: the model's
        context, at most MAX_LENGTH)."""
        self.model, self.config, self.decoder = model, model.config, model.get_decoder()
        self.device, self.dtype = model.device, model.dtype
        context = getattr(self.config, "max_position_embeddings", None) or MAX_LENGTH
        self.max_length = max_length or min(MAX_LENGTH, context)
        widths = tuple(w for w in WIDTHS if w <= self.max_length) if widths is None else widths
        if any(not 1 <= w <= self.max_length for w in widths):
            raise ValueError(f"graph widths {list(widths)} must be between 1 and max_length {self.max_length}")
        self.widths = tuple(sorted(widths))
        self.graph_widths = self.widths if graphs and self.device.type == "cuda" else ()
        self.windows = attention_windows(self.config)
        self.use_cache(StaticKV(self.config, self.max_length))
        self.layers: tuple[int, ...] = ()
        self.captured: torch.Tensor | None = None
        self._drop_graphs()

    def use_cache(self, cache: StaticKV) -> None:
        """Run on `cache`; with sliding windows, the positions of the keys at each of its slots are kept beside it
        (a tree's keep reorders them), and its masks come one a layer type where the config names layer types."""
        self.cache = cache
        if self.windows is not None:
            cache.mask_types = tuple(self.windows) if names_layer_types(self.config) else None
            self.key_positions = torch.zeros(cache.max_length, dtype=torch.long, device=self.device)

    def reset(self) -> None:
        self.cache.length = 0

    def cached(self) -> int:
        return self.cache.length

    def capture(self, layers: tuple[int, ...]) -> None:
        self.layers = tuple(layers)
        self._drop_graphs()  # graphs captured before return no features

    def crop(self, length: int) -> None:
        self.cache.length = min(self.cache.length, length)

    @torch.inference_mode()
    def keep(self, index: torch.Tensor) -> None:
        index = index.to(self.device)
        for buffer in (b for pair in self.cache.buffers or () for b in pair):
            buffer[:, :, : len(index)] = buffer.index_select(2, index)
        if self.windows is not None:
            self.key_positions[: len(index)] = self.key_positions[index]
        self.cache.length = len(index)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor | None) -> torch.Tensor:
        width, cached = ids.shape[1], self.cache.length
        if cached + width > self.max_length:
            raise DecodeError(f"the static runner holds {self.max_length} positions: {cached} cached + {width} new do "
                              "not fit (a larger max_length, or a shorter prompt or max_new_tokens)")
        rows = next((w for w in self.widths if w >= width and cached + w <= self.max_length), width)
        span = span_for(cached + rows, self.max_length)
        slots = torch.arange(cached, cached + rows, device=self.device)
        positions = extend(slots[None, :width] if positions is None else positions, rows, 1)
        mask = self._masks(static_mask(mask, cached, width, span, self.dtype, rows).to(self.device), positions, cached)
        inputs = (extend(ids, rows, 0), positions, mask, slots)
        hidden, aux = self._replay(inputs) if rows in self.graph_widths else self._run(*inputs)
        self.cache.length = cached + width
        if self.layers:
            self.captured = aux[:, :width]
        return hidden[:, :width]

    def _masks(self, mask: torch.Tensor, positions: torch.Tensor, cached: int) -> torch.Tensor:
        """`mask` [1, 1, rows, span] as the forward takes it: for a sliding-window model a stack [types, 1, rows,
        span], one a layer type (HFRunner's masks, `window_masks`), the positions of this forward's keys
        (`positions` [1, rows], padding included) recorded."""
        if self.windows is None:
            return mask
        self.key_positions[cached: cached + positions.shape[1]] = positions[0]
        masks = window_masks(mask, self.windows, positions[0], self.key_positions[: mask.shape[-1]])
        return torch.cat(list(masks.values()))

    def _run(self, ids, positions, mask, slots) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder's forward (eagerly, or recorded into a graph): last hidden states and the captured ones."""
        self.cache.slots, self.cache.span = slots, mask.shape[-1]
        return decoder_forward(self.decoder, self.cache, ids, positions, mask, self.layers)
