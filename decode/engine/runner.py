"""The seam between a model level and whatever runs its model: a *runner* is a causal LM's decoder with its own KV
cache. The engine decides what to feed and what to keep; a backend decides how the forward runs (HFRunner: any
transformers model through its public API; a backend may bring a faster one for the architectures it knows).

A backend may also make a faster forward part of a model's configuration (as packing its linears is): it sets
RUNNER_FACTORY on the model, and `configured_runner` then gives that runner to every part of decoding that runs the
model (a chain's levels and the autoregressive reference alike), so that they all compute the same logits."""
from __future__ import annotations

from typing import Any, Callable, Protocol

import torch
from transformers import DynamicCache, PreTrainedModel


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


RUNNER_FACTORY = "polyspec_runner"  # a model attribute: a function of the model giving its Runner


def configured_runner(model: PreTrainedModel) -> Runner:
    """A new runner of `model` as configured: its RUNNER_FACTORY's (a module-level function of the model, so that a
    deep copy keeps it and runs its own weights), else HFRunner."""
    factory: Callable[[PreTrainedModel], Runner] | None = vars(model).get(RUNNER_FACTORY)
    return factory(model) if factory is not None else HFRunner(model)


class HFRunner:
    """A transformers causal LM's decoder on a DynamicCache: crop = rollback, keep = index-select (a tree's path)."""

    def __init__(self, model: PreTrainedModel):
        self.model, self.config, self.decoder = model, model.config, model.get_decoder()
        self.device, self.dtype = model.device, model.dtype
        self.layers: tuple[int, ...] = ()
        self.captured: torch.Tensor | None = None
        self.reset()

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.config)

    def cached(self) -> int:
        return self.cache.get_seq_length()

    def capture(self, layers: tuple[int, ...]) -> None:
        self.layers = tuple(layers)

    def crop(self, length: int) -> None:
        extra = self.cached() - length
        if extra > 0:
            self.cache.crop(-extra)

    def keep(self, index: torch.Tensor) -> None:
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys.index_select(-2, index), layer.values.index_select(-2, index)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor | None) -> torch.Tensor:
        out = self.decoder(input_ids=ids, past_key_values=self.cache, use_cache=True, attention_mask=mask,
                           position_ids=positions, output_hidden_states=bool(self.layers))
        if self.layers:
            self.captured = torch.cat([out.hidden_states[i] for i in self.layers], dim=-1)
        return out.last_hidden_state
