"""A drafting level's LM head on int8 weights (`lm_head: int8`): on a small model the LM head is the largest single
weight, and a memory-bound forward pays for its bytes. Never for the target: it would change the output."""
from __future__ import annotations

import torch
from torch import nn


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [N, K] as int8 rows and one float32 scale each (symmetric: absmax / 127, round to nearest even)."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp_min(1e-12) / 127
    return torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


class Int8RowLinear(nn.Module):
    """Inference-only stand-in for a bias-free nn.Linear (an LM head): int8 weights, one scale per output
    row (symmetric, absmax / 127), run by aten's int8 weight-only kernel on bf16 activations, fp32 out.
    That kernel's vectorised CPU path (AVX2 is enough) takes bf16 activations; on fp32 ones it is a scalar
    loop, 3x slower than the packed fp32 weight. The original weight stays attached (state_dict unchanged)."""

    def __init__(self, linear: nn.Module):
        super().__init__()
        self.out_features, self.in_features = linear.weight.shape
        self.weight, self.bias = linear.weight, None
        self.qweight, scales = int8_rows(linear.weight)
        self.scales = scales.to(torch.bfloat16)

    def streamed_bytes(self) -> int:
        """The bytes a forward reads: the int8 rows and their scales (not the attached original weight)."""
        return self.qweight.nbytes + self.scales.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            return nn.functional.linear(x, self.weight)
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scales)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def quantize_lm_head(model: nn.Module) -> bool:
    """Give `model` an int8 LM head (Int8RowLinear) in place; False where it cannot (no kernel in this
    torch, no plain weight, a bias, not on the CPU)."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if (not hasattr(torch.ops.aten, "_weight_int8pack_mm") or not isinstance(weight, torch.Tensor)
            or getattr(head, "bias", None) is not None or weight.device.type != "cpu"):
        return False
    model.set_output_embeddings(Int8RowLinear(head))
    return True
