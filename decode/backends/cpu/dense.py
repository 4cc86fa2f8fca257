"""Dense linears on a weight packed once: `avx2` (kernels.cpp: 8-column panels, one FMA chain per output, so a row
never depends on the batch, the tiling or the thread count) or `onednn` (torch's prepacked oneDNN linear).
PyTorch's default fp32 path re-packs the weight on every call and runs small-M products far below the machine's
rate; both packed products keep the math (fp32 accumulation) in another summation order, so a packed model is a
*configuration* of the target: the chain and its AR reference must both use it."""
from __future__ import annotations

import copy
from typing import Any, NamedTuple

import torch
from torch import nn

from infra.hugepages import in_huge_pages
from decode.backends.cpu.kernels import kernel_ops

GEMMS = ("auto", "avx2", "onednn")


def packing_available() -> bool:
    """oneDNN linear with prepacked weights exists in this torch build (CPU builds with MKL-DNN)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def packable_dtypes() -> tuple[torch.dtype, ...]:
    """Weight dtypes oneDNN can pack on this CPU: bf16 needs AVX512-BF16/AVX-NE-CONVERT-class support (an
    AVX2-only EPYC refuses it at packing time), so there bf16 linears keep their plain forward."""
    bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return (torch.float32, torch.bfloat16) if bf16 is not None and bf16() else (torch.float32,)


def gemm_for(dtype: torch.dtype, gemm: str = "auto") -> str | None:
    """Which packed product a weight of `dtype` gets: "avx2", "onednn", or None (the linear stays plain)."""
    if gemm not in GEMMS:
        raise ValueError(f"gemm must be one of {', '.join(GEMMS)}, got {gemm!r}")
    if dtype == torch.float32 and gemm != "onednn":
        kernel, why = kernel_ops()
        if kernel is not None:
            return "avx2"
        if gemm == "avx2":
            raise RuntimeError(f"gemm=avx2 cannot run here ({why}); use auto or onednn")
    return "onednn" if packing_available() and dtype in packable_dtypes() else None


class Panels(NamedTuple):
    """A weight packed for the AVX2 kernel: [ceil(N/8), K, 8] panels, and N."""
    data: torch.Tensor
    rows: int


def pack_weight(weight: torch.Tensor, gemm: str) -> Panels | torch.Tensor:
    """W [N, K] in the layout of `gemm` ("avx2" or "onednn", see `gemm_for`)."""
    if gemm == "avx2":
        return Panels(kernel_ops()[0].pack(weight.contiguous()), weight.shape[0])
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def in_huge_page_panels(packed: Panels | torch.Tensor | None) -> Panels | torch.Tensor | None:
    """avx2 panels copied into transparent huge pages (hugepages.in_huge_pages): done once a packed linear is final
    (after fusion), so no panel dropped later holds huge pages; oneDNN's opaque weights stay as they are."""
    return Panels(in_huge_pages(packed.data), packed.rows) if isinstance(packed, Panels) else packed


def packed_with(model: nn.Module) -> str | None:
    """The packed product a model's dense linears run on ("avx2" or "onednn"), None if none is packed."""
    return next((m.gemm for m in model.modules() if isinstance(m, PackedLinear)), None)


def packed_mm(x: torch.Tensor, packed: Panels | torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T + b through a packed W, for any leading shape of x."""
    flat = x.reshape(-1, x.shape[-1])
    if isinstance(packed, Panels):
        out = torch.ops.polyspec.linear(flat, packed.data, packed.rows, bias)
    else:
        out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out.shape[-1])


class PackedLinear(nn.Module):
    """Inference-only stand-in for an nn.Linear: same parameters, forward through a packed weight."""

    def __init__(self, linear: nn.Linear, gemm: str = "auto"):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # shared, not copied: state_dict is unchanged
        self.gemm = gemm_for(linear.weight.dtype, gemm)
        if self.gemm is None:
            raise ValueError(f"no packed product for {linear.weight.dtype} weights on this CPU")
        self.packed = pack_weight(linear.weight.detach(), self.gemm)
        self.sibling: tuple[Any, int] | None = None  # (SiblingGroup, index), set by fusion.fuse_siblings

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype or torch.is_grad_enabled() and x.requires_grad:
            return nn.functional.linear(x, self.weight, self.bias)
        if self.sibling is not None:
            out = self.sibling[0].output(self.sibling[1], x)
            return out if out is not None else nn.functional.linear(x, self.weight, self.bias)
        return packed_mm(x, self.packed, None if self.bias is None else self.bias.detach())

    def streamed_bytes(self) -> int:
        """The bytes a forward reads: the avx2 panels (padded to whole panels) or, oneDNN's being opaque, the weight's
        own size; and the bias."""
        weight = self.packed.data if isinstance(self.packed, Panels) else self.weight
        return weight.nbytes + (0 if self.bias is None else self.bias.nbytes)

    def __deepcopy__(self, memo: dict) -> "PackedLinear":
        """Parameters are copied as usual; the packed weight (oneDNN's is an opaque tensor that cannot be
        copied) is shared with the copy, which is correct while weights stay frozen, as at inference.
        A fused sibling's copy gets its own packed weight and runs unfused."""
        clone = copy.copy(self)
        clone._parameters = copy.deepcopy(self._parameters, memo)
        clone._buffers = copy.deepcopy(self._buffers, memo)
        clone._modules = {}
        clone.__dict__ = {**clone.__dict__}
        if clone.sibling is not None:  # a copy runs alone (its own weights may change): repack it
            clone.sibling = None
            clone.packed = pack_weight(clone.weight.detach(), clone.gemm)
        return clone

    def to_linear(self) -> nn.Linear:
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                           device=self.weight.device, dtype=self.weight.dtype)
        linear.weight, linear.bias = self.weight, self.bias
        return linear


def packed_or_plain(linear: nn.Linear, gemm: str = "auto") -> nn.Module:
    """`linear` on a packed product where one runs for its dtype (its panels in huge pages), else unchanged."""
    if not gemm_for(linear.weight.dtype, gemm):
        return linear
    packed = PackedLinear(linear, gemm)
    packed.packed = in_huge_page_panels(packed.packed)
    return packed
