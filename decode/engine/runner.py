"""The seam between a model level and whatever runs its model: a *runner* is a causal LM's decoder with its own KV
cache. The engine decides what to feed and what to keep; a backend decides how the forward runs (HFRunner: any
transformers model through its public API; a backend may bring a faster one for the architectures it knows).

What a backend makes of a model is a value, `Prepared`, held beside the model: nothing is written onto the model, so
the same loaded weights can be run by two backends, and every part of decoding that runs a prepared model (a chain's
levels and the autoregressive reference alike) gets its runners from the same `new_runner` and computes the same
logits."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import get_layer_types_and_kwargs

from heads.eagle import causal_mask


class Runner(Protocol):
    """A decoder with a KV cache. `forward` feeds ids [1, T] after the cached positions (mask None = causal, else an
    additive float mask [1, 1, T, cached + T]; positions None = cached .. cached + T - 1, else ids [1, T]) and returns
    the last hidden states after the final norm, [1, T, hidden]. The LM head is not the runner's: the level applies
    it.

    For an EAGLE-3 level below, `capture(layers)` asks every later forward to also leave the hidden states entering
    those decoder layers (HF's `output_hidden_states[i]`) side by side in `captured`, [1, T, len(layers) * hidden]."""

    config: Any
    device: torch.device
    dtype: torch.dtype

    def cached(self) -> int: ...

    def capture(self, layers: tuple[int, ...]) -> None: ...

    def crop(self, length: int) -> None: ...

    def keep(self, index: torch.Tensor) -> None: ...

    def reset(self) -> None: ...

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor | None) -> torch.Tensor: ...


@dataclass(frozen=True)
class Prepared:
    """A model as a backend runs it: `new_runner()` gives a runner with its own KV cache (one per chain level or
    reference decoder), `lm_head` turns the runner's hidden states into logits."""

    model: PreTrainedModel
    new_runner: Callable[[], Runner]
    lm_head: nn.Module


def as_prepared(model: PreTrainedModel | Prepared) -> Prepared:
    """A prepared model as it is; a plain model as transformers runs it (HFRunner, its own output embedding)."""
    if isinstance(model, Prepared):
        return model
    return Prepared(model, functools.partial(HFRunner, model), model.get_output_embeddings())


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Forget a DynamicCache's positions >= length."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def attention_windows(config: Any) -> dict[str, int | None] | None:
    """{layer type: its sliding window, None for full attention} of a model some of whose layers attend through a
    sliding window (Mistral, Qwen2's use_sliding_window, Gemma 2 and 3), by transformers' own reading of the config;
    None for a model without one (or with layer types other than full and sliding attention, left to transformers)."""
    types, kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    if "sliding_attention" not in types or not set(types) <= {"full_attention", "sliding_attention"}:
        return None
    return {kind: args.get("sliding_window") for kind, args in zip(types, kwargs)}


def names_layer_types(config: Any) -> bool:
    """Whether the config names its layers' types: its decoder then takes one mask a type ({layer type: mask}),
    else one mask for every layer (Mistral's)."""
    return bool(getattr(config.get_text_config(decoder=True), "layer_types", None))


def window_masks(mask: torch.Tensor, windows: dict[str, int | None], queries: torch.Tensor,
                 keys: torch.Tensor) -> dict[str, torch.Tensor]:
    """{layer type: `mask` with its window applied} for `windows` (attention_windows'): a query at position p sees
    keys at positions p - window < q <= p, by position (a tree's node at its depth's). `queries` and `keys`: the
    positions of the mask's rows and columns."""
    distance = queries[:, None] - keys[None, :]
    fill = torch.finfo(mask.dtype).min
    return {kind: mask if window is None else mask.masked_fill(distance >= window, fill)
            for kind, window in windows.items()}


class HFRunner:
    """A transformers causal LM's decoder on a DynamicCache: crop = rollback, keep = index-select (a tree's path).

    A model with sliding-window layers runs on a cache whose every layer keeps every key and value (transformers'
    sliding layers evict what the window passed, so they can neither roll back nor keep a tree's path), and the
    window is applied in the attention mask, by position: a query at position p sees keys at p - window < q <= p."""

    def __init__(self, model: PreTrainedModel):
        self.model, self.config, self.decoder = model, model.config, model.get_decoder()
        self.device, self.dtype = model.device, model.dtype
        self.layers: tuple[int, ...] = ()
        self.captured: torch.Tensor | None = None
        self.windows = attention_windows(self.config)
        self.typed = names_layer_types(self.config)
        self.reset()

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.config) if self.windows is None else DynamicCache()
        self.positions = torch.zeros(0, dtype=torch.long, device=self.device)  # of the cached keys, with windows

    def cached(self) -> int:
        return self.cache.get_seq_length()

    def capture(self, layers: tuple[int, ...]) -> None:
        self.layers = tuple(layers)

    def crop(self, length: int) -> None:
        crop_cache(self.cache, length)
        self.positions = self.positions[:length]

    def keep(self, index: torch.Tensor) -> None:
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys.index_select(-2, index), layer.values.index_select(-2, index)
        if self.windows is not None:
            self.positions = self.positions[index]

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor | None) -> torch.Tensor:
        if self.windows is not None:
            mask = self._window_masks(ids.shape[1], mask, positions)
        out = self.decoder(input_ids=ids, past_key_values=self.cache, use_cache=True, attention_mask=mask,
                           position_ids=positions, output_hidden_states=bool(self.layers))
        if self.layers:
            self.captured = torch.cat([out.hidden_states[i] for i in self.layers], dim=-1)
        return out.last_hidden_state

    def _window_masks(self, length: int, mask: torch.Tensor | None,
                      positions: torch.Tensor | None) -> torch.Tensor | dict[str, torch.Tensor]:
        """The additive masks [1, 1, T, cached + T] of each layer type for feeding `length` tokens: `mask` (None:
        causal) with the window applied on sliding layers; one mask where the config names no layer types (every
        layer slides, as Mistral's), else {layer type: mask}, which transformers' decoders take as given."""
        past = self.cached()
        queries = positions[0] if positions is not None else torch.arange(past, past + length, device=self.device)
        self.positions = torch.cat([self.positions, queries])
        if mask is None:
            mask = causal_mask(length, past, self.dtype, self.device)
        masks = window_masks(mask, self.windows, queries, self.positions)
        return masks if self.typed else masks["sliding_attention"]


class HeadRunner(Protocol):
    """A draft head's decoder with its KV cache: `forward` feeds ids [1, T] with the features they pair with
    [1, T, feature size] after the cached positions (mask and positions as a Runner's) and returns the head's hidden
    states [1, T, hidden], the features its next step feeds back. The LM head is the level's."""

    def cached(self) -> int: ...

    def crop(self, length: int) -> None: ...

    def reset(self) -> None: ...

    def forward(self, ids: torch.Tensor, features: torch.Tensor, mask: torch.Tensor | None,
                positions: torch.Tensor | None) -> torch.Tensor: ...


class HFHeadRunner:
    """A draft head module's own forward on a DynamicCache (any head: EAGLE-2's, EAGLE-3's)."""

    def __init__(self, head: nn.Module):
        self.head = head
        self.reset()

    def reset(self) -> None:
        self.cache = DynamicCache()

    def cached(self) -> int:
        return self.cache.get_seq_length()

    def crop(self, length: int) -> None:
        crop_cache(self.cache, length)

    def forward(self, ids: torch.Tensor, features: torch.Tensor, mask: torch.Tensor | None,
                positions: torch.Tensor | None) -> torch.Tensor:
        hidden, _, self.cache = self.head(ids, features, past_key_values=self.cache, position_ids=positions,
                                          attention_mask=mask, compute_logits=False)
        return hidden


@dataclass(frozen=True)
class PreparedHead:
    """A draft head as a backend runs it: `new_runner()` gives a head runner with its own KV cache (one per chain),
    `lm_head` its draft-vocabulary rows as the backend runs them (None: the head computes its logits itself)."""

    head: nn.Module
    new_runner: Callable[[], HeadRunner]
    lm_head: nn.Module | None = None


def as_prepared_head(head: nn.Module | PreparedHead) -> PreparedHead:
    """A prepared head as it is; a plain head module on its own forward."""
    if isinstance(head, PreparedHead):
        return head
    return PreparedHead(head, functools.partial(HFHeadRunner, head))
