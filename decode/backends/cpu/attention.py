"""Attention for packed CPU models, registered with transformers by name (`register`, called by the backend).

HF's sdpa attention copies every layer's K and V cache to the query head count whenever a mask is given (every
verification): `grouped_sdpa_attention` takes grouped heads directly. For fp32, `kernel_attention` runs kernels.cpp's
`attend`: grouped heads read in place, each query row computed by one fixed sequence over the keys it sees, so a
k-token forward gives the bits of its k one-token forwards (row-exact verification)."""
from __future__ import annotations

import functools
import sys
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask


GROUPED_SDPA = "polyspec_grouped_sdpa"
KERNEL_ATTENTION = "polyspec_attend"


def grouped_sdpa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """HF's sdpa attention without `repeat_kv` when a mask is given on the CPU (see the module docstring);
    every other case (no mask, one K/V head per query head, position bias, paged caches) is HF's own.
    transformers passes `dropout`, `scaling` and `is_causal` among the keyword arguments."""
    if (attention_mask is None or getattr(module, "num_key_value_groups", 1) == 1 or query.device.type != "cpu"
            or _special(kwargs)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out = nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                     dropout_p=kwargs.get("dropout", 0.0),
                                                     scale=kwargs.get("scaling"), enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def kernel_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """fp32 attention on the `attend` kernel (row-exact, grouped heads read in place, see the module docstring;
    a static cache's runner passes `key_length`, its valid prefix as a tensor, and only those keys are read; Gemma 2's
    score softcapping included); anything it does not cover (other dtypes, dropout, position bias, attention sinks)
    goes to `grouped_sdpa_attention`."""
    if (query.device.type != "cpu" or kwargs.get("dropout") or _special({**kwargs, "softcap": None})
            or not query.dtype == key.dtype == value.dtype == torch.float32
            or query.shape[-1] % 8 or query.shape[-1] > 256
            or attention_mask is not None and attention_mask.dtype not in (torch.bool, torch.float32)):
        if kwargs.get("softcap") is not None:  # sdpa has no softcapping: the model's own eager attention does
            return sys.modules[type(module).__module__].eager_attention_forward(
                module, query, key, value, attention_mask, **kwargs)
        return grouped_sdpa_attention(module, query, key, value, attention_mask, **kwargs)
    is_causal = kwargs.get("is_causal")
    causal = attention_mask is None and query.shape[2] > 1 and (
        is_causal if is_causal is not None else getattr(module, "is_causal", True))
    scaling = kwargs.get("scaling")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return torch.ops.polyspec.attend(query, key, value, attention_mask, scale, causal, kwargs.get("key_length"),
                                     kwargs.get("softcap") or 0.0), None


def _special(kwargs: dict) -> bool:
    """Attention features only HF's own sdpa path implements."""
    return (any(kwargs.get(k) is not None for k in ("position_bias", "cache", "softcap", "s_aux", "sinks"))
            or bool(kwargs.get("output_attentions")))


def packed_attention(config: Any, product: str | None) -> str | None:
    """The attention a model packed on `product` runs: on the AVX2 product the kernel, for sdpa models and for eager
    ones whose eager need is softcapping (Gemma 2: the kernel caps); on oneDNN grouped sdpa; None: its own."""
    if config._attn_implementation == "sdpa":
        return KERNEL_ATTENTION if product == "avx2" else GROUPED_SDPA
    if config._attn_implementation == "eager" and softcapped(config) and product == "avx2":
        return KERNEL_ATTENTION
    return None


def use_packed_attention(config: Any, product: str | None) -> None:
    """A module that is no transformers model (a draft head's layer, reading `config` at every call) on the
    attention a model packed on `product` runs (`packed_attention`; None: nothing packed, its own)."""
    implementation = packed_attention(config, product) if product is not None else None
    if implementation is not None:
        register()
        config._attn_implementation = implementation


def unpacked_attention(config: Any) -> str:
    """transformers' attention for a model no longer packed: eager where scores are softcapped, else sdpa."""
    return "eager" if softcapped(config) else "sdpa"


def softcapped(config: Any) -> bool:
    return bool(getattr(config, "attn_logit_softcapping", None))


@functools.cache
def register() -> None:
    """Make both attention functions known to transformers (once per process)."""
    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)
    AttentionInterface.register(KERNEL_ATTENTION, kernel_attention)
    AttentionMaskInterface.register(KERNEL_ATTENTION, sdpa_mask)
