"""Sibling linears (those reading the same activation: q/k/v, gate/up) run as one product over their stacked rows.
Siblings are found by tracing one forward (consecutive calls on the very same input tensor), not from module
names, so any architecture gets it; the fusion is kept only if that forward's logits are bit-identical."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from decode.backends.cpu.dense import PackedLinear, _packed_mm, pack_weight
from decode.backends.cpu.int4 import _int4_mm, is_lean_int4

class SiblingGroup:
    """Linears that read the same activation, run as one product over their stacked rows.

    The first sibling (in call order) computes everything and keeps the output with a strong reference to
    its input; each later sibling takes its slice only if it is handed that very input tensor, otherwise
    it computes alone. So a call order other than the traced one costs time, never correctness."""

    def __init__(self, members: list[nn.Module], run: Callable[[torch.Tensor], torch.Tensor]):
        sizes = [m.out_features for m in members]
        self.bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        self.run = run
        self.input: torch.Tensor | None = None
        self.out: torch.Tensor | None = None

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor | None:
        if index == 0:
            self.input, self.version, self.out = x, _version(x), self.run(x)
        elif x is not self.input or _version(x) != self.version:
            return None
        out = self.out[..., self.bounds[index]:self.bounds[index + 1]]
        if index == len(self.bounds) - 2:
            self.input = self.out = None
        return out


def _version(x: torch.Tensor) -> int | None:
    """In-place writes bump a tensor's version; inference tensors have none (and nothing writes them here)."""
    return None if x.is_inference() else x._version



def _siblings(model: nn.Module, ids: torch.Tensor) -> tuple[list[list[nn.Module]], torch.Tensor]:
    """Runs of consecutive packed (or lean int4) linear calls on the same input tensor, in one traced
    forward; and that forward's logits."""
    calls: list[tuple[nn.Module, torch.Tensor]] = []
    linears = [m for m in model.modules() if isinstance(m, PackedLinear) or is_lean_int4(m)]
    hooks = [m.register_forward_pre_hook(lambda m, args: calls.append((m, args[0]))) for m in linears]
    try:
        with torch.inference_mode():
            logits = model(input_ids=ids, use_cache=False).logits
    finally:
        for hook in hooks:
            hook.remove()
    runs: list[list[tuple[nn.Module, torch.Tensor]]] = []
    for module, x in calls:
        last = runs[-1] if runs else None
        if last and x is last[0][1] and type(module) is type(last[0][0]) and all(module is not m for m, _ in last):
            last.append((module, x))
        else:
            runs.append([(module, x)])
    return [[m for m, _ in run] for run in runs if len(run) > 1], logits


class StackedProduct:
    """The stacked product of packed siblings: their weight packed once and their bias, kept where the native
    runner (decode.backends.cpu.llama) can share them instead of packing its own copy."""

    def __init__(self, packed: Any, bias: torch.Tensor | None):
        self.packed, self.bias = packed, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _packed_mm(x, self.packed, self.bias)


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
    return lambda x: _int4_mm(x, first.gather_index, qweight, first.group_size, scales_and_zeros, bias)


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

