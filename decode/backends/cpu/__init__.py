"""The CPU backend: every linear of a model runs on a weight packed once (dense: `dense`, GPTQ int4: `int4`),
siblings fused (`fusion`), attention without repeat_kv (`attention`); the parameters stay in place (state_dict,
weights hashes and training see the same model), the packed copies are an inference-time cache."""
from __future__ import annotations

from torch import nn
from transformers import PreTrainedModel

from decode.backends.cpu import attention
from decode.backends.cpu.dense import PackedLinear, gemm_for, in_huge_page_panels, packed_with
from decode.backends.cpu.fusion import StackedProduct, fuse_siblings
from decode.backends.cpu.int4 import repackable_int4, pack_int4, is_lean_int4


def _children(model: nn.Module):
    for parent in model.modules():
        for name, child in list(parent.named_children()):
            yield parent, name, child


def pack(model: nn.Module, gemm: str = "auto") -> int:
    """Swap every CPU nn.Linear of a float32 (bfloat16 where oneDNN packs it) model for a PackedLinear on the
    `gemm` product (see `gemm_for`) and give every CPU GPTQ int4 linear the lean forward, in place; returns how
    many layers changed. Dense layers no packed product can run stay plain; the panels the model then runs on lie
    in huge pages (infra.hugepages)."""
    count = 0
    for parent, name, child in _children(model):
        if repackable_int4(child):
            pack_int4(child)
            count += 1
        elif (type(child) is nn.Linear and child.weight.device.type == "cpu"
              and gemm_for(child.weight.dtype, gemm) is not None):
            setattr(parent, name, PackedLinear(child, gemm))
            count += 1
    if count and isinstance(model, PreTrainedModel):
        fuse_siblings(model)
        implementation = attention.packed_attention(model.config, packed_with(model))
        if implementation is not None:
            attention.register()
            model.set_attn_implementation(implementation)
    if count:  # a model packed before keeps its panels where they lie
        _to_huge_pages(model)
    return count


def _to_huge_pages(model: nn.Module) -> None:
    """The panels the packed model runs on (its packed linears' and their stacked siblings'), once final, into huge
    pages (infra.hugepages)."""
    for m in model.modules():
        if isinstance(m, PackedLinear):
            m.packed = in_huge_page_panels(m.packed)
            stacked = m.sibling[0].run if m.sibling is not None and m.sibling[1] == 0 else None
            if isinstance(stacked, StackedProduct):
                stacked.packed = in_huge_page_panels(stacked.packed)


def unpack(model: nn.Module) -> int:
    """Undo `pack`: plain nn.Linear forwards, transformers' own attention again (e.g. before training or
    moving to another device)."""
    count = 0
    if isinstance(model, PreTrainedModel) and model.config._attn_implementation in (attention.GROUPED_SDPA,
                                                                                     attention.KERNEL_ATTENTION):
        model.set_attn_implementation(attention.unpacked_attention(model.config))
    for parent, name, child in _children(model):
        if isinstance(child, PackedLinear):
            setattr(parent, name, child.to_linear())
            count += 1
        elif is_lean_int4(child):
            del child.forward  # back to the class's own forward (the int4pack layout stays: it is the kernel's)
            child.sibling = None
            count += 1
    return count
