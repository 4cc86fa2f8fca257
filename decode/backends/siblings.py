"""Sibling linears, those reading the same activation (q/k/v, gate/up), run as one product over their stacked rows:
one launch where there were three (two), on any device. Siblings are found by tracing one forward (consecutive calls
on the very same input tensor), not from module names, so any architecture gets it. The CPU backend stacks its packed
linears this way (decode.backends.cpu.fusion); `stack_siblings` does it for plain and int4pack linears, the compiled
static runners' (decode.backends.static), where the stacked product is one kernel of the compiled graph."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from decode.backends.int4pack import Int4Linear, Int4Pack


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
    """In-place writes bump a tensor's version; inference tensors have none (and nothing writes them here), nor do
    traced ones (a compiled graph is traced from the model's own forward, which does not write a shared input)."""
    return None if torch.compiler.is_compiling() or x.is_inference() else x._version


def sibling_runs(forward: Callable[[], object], linears: list[nn.Module]) -> list[list[nn.Module]]:
    """Runs of two or more consecutive calls of `linears` of one type on the same input tensor, in one `forward`."""
    calls: list[tuple[nn.Module, torch.Tensor]] = []
    hooks = [m.register_forward_pre_hook(lambda m, args: calls.append((m, args[0]))) for m in linears]
    try:
        with torch.inference_mode():
            forward()
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
    return [[m for m, _ in run] for run in runs if len(run) > 1]


class SiblingLinear(nn.Linear):
    """An nn.Linear (its own parameters under the same names: state_dict unchanged) that takes its slice of its
    siblings' stacked product (`sibling`: the group and its index)."""

    def __init__(self, linear: nn.Linear, sibling: tuple[SiblingGroup, int]):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.sibling = sibling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.sibling[0].output(self.sibling[1], x)
        return out if out is not None else nn.functional.linear(x, self.weight, self.bias)


def _stacked_linear(members: list[nn.Linear]) -> nn.Linear:
    """One linear over the members' rows; each member's weight and bias become views of it (no second copy)."""
    weight = torch.cat([m.weight.detach() for m in members])
    bias = any(m.bias is not None for m in members)
    stacked = nn.utils.skip_init(nn.Linear, weight.shape[1], weight.shape[0], bias=bias, device=weight.device,
                                 dtype=weight.dtype).requires_grad_(False)
    stacked.weight.data = weight
    if stacked.bias is not None:
        stacked.bias.data = torch.cat([m.bias.detach() if m.bias is not None else weight.new_zeros(m.out_features)
                                       for m in members])
    start = 0
    for m in members:
        m.weight.data = stacked.weight.data[start: start + m.out_features]
        if m.bias is not None:
            m.bias.data = stacked.bias.data[start: start + m.out_features]
        start += m.out_features
    return stacked


def _stacked_int4(members: list[Int4Linear]) -> Int4Linear | None:
    """One Int4Linear over the members' rows, or None where the members differ in group size or their packed weights
    do not stack. torch's int4 layouts tile the outputs, so stacking rows stacks the packed weight along its first
    dimension and the scales along their second, where each member fills whole tiles (a CPU pack's are 64 rows: two
    32-row members pack otherwise than their 64 rows would): kept only where a probe's product is its members'."""
    first = members[0]
    if any(m.group_size != first.group_size or (m.bias is None) != (first.bias is None) for m in members):
        return None
    packed = Int4Pack(torch.cat([m.weight_int4pack for m in members]),
                      torch.cat([m.scales_and_zeros for m in members], dim=1), first.group_size, first.in_features,
                      sum(m.out_features for m in members))
    stacked = Int4Linear(packed, None if first.bias is None else torch.cat([m.bias for m in members]))
    probe = torch.randn(2, first.in_features, dtype=first.scales_and_zeros.dtype, device=first.weight_int4pack.device,
                        generator=torch.Generator(first.weight_int4pack.device).manual_seed(0))
    with torch.inference_mode():
        alone, together = torch.cat([m(probe) for m in members], dim=-1), stacked(probe)
    return stacked if (together - alone).abs().max() <= 1e-3 * alone.abs().max() else None


def stack_siblings(module: nn.Module, forward: Callable[[], object]) -> int:
    """Run `module`'s sibling nn.Linears and Int4Linears (found in one `forward` of it) as one product each, in place
    (a plain linear becomes a SiblingLinear, an Int4Linear gets its `sibling`); returns how many groups."""
    linears = [m for m in module.modules() if type(m) is nn.Linear or type(m) is Int4Linear and m.sibling is None]
    where = {id(child): (parent, name) for parent in module.modules() for name, child in parent.named_children()}
    groups = 0
    for members in sibling_runs(forward, linears):
        stacked = _stacked_linear(members) if type(members[0]) is nn.Linear else _stacked_int4(members)
        if stacked is None:
            continue
        group = SiblingGroup(members, stacked)
        for index, member in enumerate(members):
            if isinstance(member, Int4Linear):
                member.sibling = (group, index)
            else:
                parent, name = where[id(member)]
                setattr(parent, name, SiblingLinear(member, (group, index)))
        groups += 1
    return groups
