"""GPTQModel's CPU int4 linears (TorchFusedLinear) without their per-call Python wrapper: cast to bf16, act-order
gather, aten's int4 kernel, cast back: the same kernel and math (identical logits), far fewer ops per call."""
from __future__ import annotations

import torch
from torch import nn


def _int4_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """TorchFusedLinear's CPU inference path without its wrapper (bound to the module by `pack`)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return type(self).forward(self, x)
    sibling = getattr(self, "sibling", None)
    out = sibling[0].output(sibling[1], x) if sibling is not None else None
    if out is not None:
        return out
    return int4_mm(x, self.gather_index, self.qweight, self.group_size, self.scales_and_zeros, self.bias)


def int4_mm(x: torch.Tensor, gather_index: torch.Tensor, qweight: torch.Tensor, group_size: int,
             scales_and_zeros: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).index_select(1, gather_index)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, qweight, group_size, scales_and_zeros)
    if bias is not None:
        out.add_(bias)
    return out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])


def repackable_int4(module: nn.Module) -> bool:
    """A GPTQModel TorchFusedLinear on the CPU, in eval mode, not yet used for training."""
    mode = getattr(module, "linear_mode", "absent")
    return (type(module).__name__ == "TorchFusedLinear" and hasattr(module, "transform") and not module.training
            and (mode is None or getattr(mode, "name", "") == "INFERENCE") and module.qweight.device.type == "cpu"
            and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"))


def pack_int4(module: nn.Module) -> None:
    """Repack once as the module's own first inference forward would (int4pack layout, act-order index),
    then bind the lean forward to the instance; its tensors and state_dict keys stay where they were."""
    if module.linear_mode is None:
        from gptqmodel.looper.linear_mode import LinearMode

        module.transform(torch.bfloat16, "cpu")
        module.linear_mode = LinearMode.INFERENCE
    module.gather_index = module.ret_idx.long()
    module.forward = _int4_forward.__get__(module)



def is_lean_int4(module: nn.Module) -> bool:
    return getattr(vars(module).get("forward"), "__func__", None) is _int4_forward
