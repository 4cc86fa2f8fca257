"""An EAGLE-2 draft head (heads.eagle.EagleHead, vLLM's method "eagle") on the native decoder: its one decoder layer
in one C++ call with a preallocated KV cache whose rollback is setting a length, as decode.backends.cpu.llama runs a
whole target.

The head's eager forward spends most of its time outside its weights (a layer's worth of small aten ops, a
DynamicCache that concatenates, a rotary table per call), and it runs several times a round. Here `fc` runs on its
packed panels, then the layer (identity input norm, no final norm: the head's function) runs natively; norms, rotary
and SiLU round as the native target's do, so the head's drafts are those of the same function up to float rounding,
and every row is computed as a one-token forward would be (tree drafts included). Drafts are proposals: the levels
above verify every token, so this changes acceptance at most, never the output. That is also why a head may run on
int8 rows (`weights: int8`: fc, the layer and the draft LM head at a quarter of their fp32 bytes, on int8 activations,
row-exact as the W4 level's products are): its forward reads ~7 MB instead of ~27.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn

from decode.backends.cpu.int8 import Int8RowLinear
from decode.backends.cpu.llama import (MAX_CAPACITY, NativeCache, NativeInt8Linear, config_problem, dense_problem,
                                       layer_weights, native_kernels, rotary_tables)
from infra.timing import module_bytes

LINEARS = ("fc", "layers.0.self_attn.q_proj", "layers.0.self_attn.k_proj", "layers.0.self_attn.v_proj",
           "layers.0.self_attn.o_proj", "layers.0.mlp.gate_proj", "layers.0.mlp.up_proj", "layers.0.mlp.down_proj")


def head_unsupported(head: nn.Module) -> str | None:
    """Why `head` cannot run natively here, or None: an EAGLE-2 head of a Llama-family target whose linears are
    float32 CPU ones (plain, or packed for the avx2 product), and kernels that build."""
    if getattr(head, "method", None) != "eagle":
        return f"method {getattr(head, 'method', None)!r}: the native layer is an EAGLE-2 head's (method 'eagle')"
    problem = config_problem(head.config)
    for name in LINEARS:
        problem = problem or dense_problem(head.get_submodule(name), name)
    if problem is None and not isinstance(head.layer.input_layernorm, nn.Identity):
        problem = "its layer has an input norm"
    return problem or (native_kernels()[1] or None)


def _native_layer(head: nn.Module, capacity: int, int8: bool) -> Any:
    """The C++ decoder of the head's layer (`int8`: on int8 rows): no embedding of its own (it is fed fc's output), no
    input or final norm."""
    kernels, config, layer = native_kernels()[0], head.config, head.layer
    cos, sin = rotary_tables(head.position_embeddings, capacity)
    native = kernels.Decoder(head.embed_tokens.weight.detach(), None, cos, sin, config.num_attention_heads,
                             config.num_key_value_heads, config.rms_norm_eps, 1)
    native.add_layer(None, layer.post_attention_layernorm.weight.detach().float(),
                     *layer_weights(kernels, layer, None, int8=int8))
    return native


def int8_problem(head: nn.Module) -> str | None:
    """Why `head` cannot run on int8 rows, or None: it runs natively, and every linear's inputs (the LM head's too)
    come in whole blocks of the int8 activations' 16."""
    problem = head_unsupported(head)
    if problem is not None:
        return problem
    for name in (*LINEARS, "lm_head"):
        inputs = head.get_submodule(name).weight.shape[1]
        if inputs % 16:
            return f"{name} reads {inputs} inputs, not a multiple of 16"
    return None


def int8_linear(linear: nn.Module) -> nn.Module:
    """A bias-free linear of a head (fc, the draft LM head rows) on int8 rows, on the native kernel."""
    if getattr(linear, "bias", None) is not None:
        raise ValueError("weights: int8 takes bias-free linears (an EAGLE-2 head's fc and LM head)")
    return NativeInt8Linear(Int8RowLinear(linear))


def native_head_runners(head: nn.Module, int8: bool = False) -> Callable[[], "NativeHeadRunner"]:
    """New native runners of `head` (HeadRunner), sharing one decoder built from its weights now (`int8`: fc and the
    layer on int8 rows); a ValueError where it cannot run natively."""
    problem = head_unsupported(head)
    if problem is not None:
        raise ValueError(f"the native runner cannot run this head: {problem}")
    capacity = min(MAX_CAPACITY, getattr(head.config, "max_position_embeddings", MAX_CAPACITY))
    fc = int8_linear(head.fc) if int8 else head.fc
    return functools.partial(NativeHeadRunner, head, _native_layer(head, capacity, int8), capacity, fc)


class NativeHeadRunner(NativeCache):
    """An EAGLE-2 head's forward with its own KV cache (the HeadRunner an EagleLevel drives)."""

    def __init__(self, head: nn.Module, native: Any, capacity: int, fc: nn.Module | None = None):
        super().__init__(1, head.config.num_key_value_heads, capacity, native.head_dim())
        self.fc, self.embed, self.native = fc or head.fc, head.embed_tokens, native

    def streamed_bytes(self) -> int:
        """The bytes a one-token forward reads now: fc's panels, the layer's (its own count) and the cached keys and
        values (an embedding row and rotary row per token aside)."""
        return module_bytes(self.fc) + self.native.weight_bytes() + self.cached_bytes()

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, features: torch.Tensor, mask: torch.Tensor | None,
                positions: torch.Tensor | None) -> torch.Tensor:
        """ids [1, T] and their features [1, T, hidden] after the cached positions; mask None (causal) or additive
        [1, 1, T, cached + T]; positions None (cached .. cached + T - 1) or [1, T]. Returns [1, T, hidden] float32."""
        t = ids.shape[-1]
        positions = self.positions(t, positions)
        x = self.fc(torch.cat([self.embed(ids).float(), features.float()], dim=-1))
        mask = None if mask is None else mask.float()
        hidden = self.native.forward_states(x.reshape(t, -1), positions, mask,
                                            self.length, self.keys, self.values)
        self.length += t
        return hidden[None]
