"""A GPTQ W4 model's int4 linears on the project's int4 tiles as torch operators (polyspec::packed_linear), for the
compiled static runner on a CPU: the native runner's W4 weights and products (int8 or fp32 activations, row-exact), in
modules any compiled forward calls as one opaque kernel each; sibling linears (q/k/v, gate/up: found by tracing, so any
family) stacked into one product where they share their act order and group size."""
from __future__ import annotations

import types
from typing import NamedTuple

import torch
from torch import nn

from decode.backends.cpu.kernels import kernel_ops
from decode.backends.cpu.llama import w4_siblings
from decode.backends.siblings import SiblingGroup, sibling_runs


class KernelWeight(NamedTuple):
    """A packed weight's parts as polyspec::packed_linear takes them (packed_linear.h's PackedWeight)."""

    words: torch.Tensor
    n: int
    scales: torch.Tensor | None = None
    bounds: torch.Tensor | None = None
    perm: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.words, self.scales, self.bounds, self.perm, self.bias) if t is not None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.polyspec.packed_linear(x, self.words, self.n, self.scales, self.bounds, self.perm, self.bias)


def op_packers() -> types.SimpleNamespace:
    """The native packers' `kernels` (decode.backends.cpu.llama) on the operators: a weight they build is a
    KernelWeight."""
    ops = kernel_ops()[0]
    return types.SimpleNamespace(PackedWeight=KernelWeight, pack_int4=ops.pack_int4, pack_int4_a8=ops.pack_int4_a8)


class KernelLinear(nn.Module):
    """Inference-only stand-in for a GPTQModel CPU int4 linear: the same parameters and buffers under the same names
    (state_dict unchanged), forward through a KernelWeight, or its slice of its siblings' stacked product."""

    def __init__(self, source: nn.Module, weight: KernelWeight | None):
        super().__init__()
        self.in_features, self.out_features = source.in_features, source.out_features
        for name, param in source.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buffer in source.named_buffers(recurse=False):
            self.register_buffer(name, buffer, persistent=name not in source._non_persistent_buffers_set)
        self.packed, self.sibling = weight, None
        self.alone = [source]  # a stacked sibling handed another input runs GPTQModel's kernel (not a child module)

    def streamed_bytes(self) -> int:
        return 0 if self.packed is None else self.packed.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sibling is not None:
            out = self.sibling[0].output(self.sibling[1], x)
            return out if out is not None else self.alone[0](x)
        return self.packed(x)


def is_cpu_int4(module: nn.Module) -> bool:
    return type(module).__name__ == "TorchFusedLinear" and module.qweight.device.type == "cpu"


def int4_on_kernels(model: nn.Module, activations: str) -> int:
    """Swap every CPU GPTQModel int4 linear of `model` for a KernelLinear on `activations` (int8 | fp32), siblings
    stacked, in place; returns how many linears moved (none where the kernels do not build)."""
    linears = [m for m in model.modules() if is_cpu_int4(m)]
    if not linears or kernel_ops()[0] is None:
        return 0
    ids = torch.arange(2, 6)[None] % model.get_input_embeddings().num_embeddings
    runs = sibling_runs(lambda: model(input_ids=ids, use_cache=False), linears)
    grouped = {id(m) for run in runs for m in run}
    packers, swapped = op_packers(), {}
    for run in runs:
        weights = w4_siblings(packers, run, activations)
        if len(weights) == 1:
            members = [KernelLinear(m, None) for m in run]
            group = SiblingGroup(members, weights[0])
            for index, member in enumerate(members):
                member.sibling = (group, index)
        else:
            members = [KernelLinear(m, w) for m, w in zip(run, weights)]
        swapped.update({id(m): k for m, k in zip(run, members)})
    for m in linears:
        if id(m) not in grouped:
            swapped[id(m)] = KernelLinear(m, w4_siblings(packers, [m], activations)[0])
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in swapped:
                setattr(parent, name, swapped[id(child)])
    return len(swapped)
