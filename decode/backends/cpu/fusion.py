"""The CPU backend's sibling linears (decode.backends.siblings: q/k/v, gate/up) on one packed product (or lean int4
call) over their stacked rows; the fusion is kept only if the traced forward's logits are bit-identical."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from decode.backends.cpu.dense import PackedLinear, packed_mm, pack_weight
from decode.backends.cpu.int4 import int4_mm, is_lean_int4
from decode.backends.siblings import SiblingGroup, sibling_runs


def _siblings(model: nn.Module, ids: torch.Tensor) -> tuple[list[list[nn.Module]], torch.Tensor]:
    """Runs of consecutive packed (or lean int4) linear calls on the same input tensor, in one traced
    forward; and that forward's logits."""
    linears = [m for m in model.modules() if isinstance(m, PackedLinear) or is_lean_int4(m)]
    logits = []
    runs = sibling_runs(lambda: logits.append(model(input_ids=ids, use_cache=False).logits), linears)
    return runs, logits[0]


class StackedProduct:
    """The stacked product of packed siblings: their weight packed once and their bias, kept where the native
    runner (decode.backends.cpu.llama) can share them instead of packing its own copy."""

    def __init__(self, packed: Any, bias: torch.Tensor | None):
        self.packed, self.bias = packed, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return packed_mm(x, self.packed, self.bias)


def _fused_run(members: list[nn.Module]) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The stacked product of `members`, or None if they cannot share one (int4 with different act-order
    or group size)."""
    first = members[0]
    if isinstance(first, PackedLinear):
        weight = torch.cat([m.weight.detach() for m in members])
        bias = None if all(m.bias is None for m in members) else torch.cat(
            [m.bias.detach() if m.bias is not None else weight.new_zeros(m.out_features) for m in members])
        return StackedProduct(pack_weight(weight, first.gemm), bias)
    if any(not torch.equal(m.gather_index, first.gather_index) or m.group_size != first.group_size for m in members):
        return None
    qweight = torch.cat([m.qweight for m in members])
    scales_and_zeros = torch.cat([m.scales_and_zeros for m in members], dim=1)
    bias = None if all(m.bias is None for m in members) else torch.cat(
        [m.bias if m.bias is not None else m.scales_and_zeros.new_zeros(m.out_features) for m in members])
    return lambda x: int4_mm(x, first.gather_index, qweight, first.group_size, scales_and_zeros, bias)


def fuse_siblings(model: nn.Module) -> int:
    """Run the packed model's sibling linears (same input, e.g. q/k/v, gate/up) as one product each, in
    place; returns how many groups were fused (0 if the fused forward was not bit-identical: undone)."""
    device = next(model.parameters()).device
    ids = torch.arange(2, 6, device=device)[None] % model.get_input_embeddings().num_embeddings
    groups, reference = _siblings(model, ids)
    fused = []
    for members in groups:
        run = _fused_run(members)
        if run is not None:
            group = SiblingGroup(members, run)
            for i, m in enumerate(members):
                m.sibling = (group, i)
            fused.append(members)
    with torch.inference_mode():
        same = torch.equal(model(input_ids=ids, use_cache=False).logits, reference)
    for m in (m for members in fused for m in members):
        if not same:
            m.sibling = None
        elif isinstance(m, PackedLinear):
            m.packed = None  # the stacked weight replaces it; a lone call falls back to the plain weight
    return len(fused) if same else 0

