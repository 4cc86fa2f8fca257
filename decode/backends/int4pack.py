"""The W4 level on torch's own int4 kernels: a GPTQ checkpoint (4 bits, static groups) converted to torch's int4-packed
layout and run by `_weight_int4pack_mm` (tinygemm, bf16, CUDA) or `_weight_int4pack_mm_for_cpu`, so the W4 model needs
neither a GPTQModel kernel nor nvcc on a GPU host.

GPTQ stores codes q (0..15, 8 per int32 along the inputs), one zero point z and one fp16 scale s per output and
group, and stands for w = s * (q - z). Its v1 checkpoints (`checkpoint_format: gptq`) store z - 1, v2 ones (`gptq_v2`)
z itself (one word at a time: GPTQModel loads v1 by adding 0x11111111 to each). torch's kernels compute
w = (q - 8) * scale + zero, so scale = s and zero = s * (8 - z): symmetric checkpoints (z = 8) get zero 0, asymmetric
ones their own. On a CPU the scales and zeros stay float32, where s * (q - z) is exact (an fp16 scale times a 5-bit
integer); tinygemm takes them in bf16, as its activations.

As gpt-fast does, the speed comes from outside the model: `load_int4pack` builds the float model's skeleton from the
checkpoint's config and swaps each quantized linear for an `Int4Linear`, whose forward is one aten call."""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from quantize.checkpoint import unpack_rows

ZERO_OFFSET = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> what is added to a stored zero point
V1_ZERO_WORD = 0x11111111  # v1 subtracts 1 from every zero point of a packed word at once (a 0 borrows from the next)
INNER_K_TILES = (8, 4, 2)  # tinygemm's choices, widest first
CUDA_GROUP_SIZES = (32, 64, 128, 256)  # tinygemm's quantization groups
GPTQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")


def cuda_shape_problem(n: int, k: int, group_size: int) -> str | None:
    """Why tinygemm cannot take an [n, k] weight in `group_size` groups, or None: its n tiles are 8 outputs wide, and
    its groups are 32-256 inputs wide and divide k (so k is a multiple of 32, and its inner k tiles, 2, 4 or 8 tiles
    of 16 inputs, divide it: `inner_k_tiles`)."""
    if n % 8:
        return f"{n} outputs: not a multiple of 8 (tinygemm's n tile)"
    if group_size not in CUDA_GROUP_SIZES or k % group_size:
        return f"group size {group_size} over {k} inputs: tinygemm takes {CUDA_GROUP_SIZES} dividing the inputs"
    return None


def inner_k_tiles(k: int) -> int | None:
    """The widest inner k tiling (8, 4, 2 tiles of 16 inputs) that divides k, or None."""
    return next((tiles for tiles in INNER_K_TILES if k % (tiles * 16) == 0), None)


@dataclass(frozen=True)
class Int4Pack:
    """One linear's weight as torch's int4 kernels take it on its device: `weight` (CPU: uint8 [n, k / 2]; CUDA: int32
    [n / 8, k / (tiles * 16), 32, tiles / 2]), `scales_and_zeros` [groups, n, 2] (w = (q - 8) * scale + zero; float32
    on a CPU, bf16 on CUDA: the activations' dtype there) and the group size."""

    weight: torch.Tensor
    scales_and_zeros: torch.Tensor
    group_size: int
    in_features: int
    out_features: int


def pack(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
         dtype: torch.dtype | None = None) -> Int4Pack:
    """Codes [n, k] (0..15), GPTQ scales and zero points [n, groups] (w = s * (q - z)), all on the device the pack is
    for, as torch's int4 layout there, its scales and zeros in `dtype` (None: bf16 on CUDA, tinygemm's only one;
    float32 on a CPU, whose kernel also takes bf16). ValueError where tinygemm cannot take the shape or dtype."""
    n, k = codes.shape
    if codes.device.type == "cuda":
        problem = cuda_shape_problem(n, k, group_size)
        if dtype not in (None, torch.bfloat16):
            problem = f"scales and zeros in {dtype}: tinygemm takes bf16 only"
        if problem is not None:
            raise ValueError(problem)
        even, odd = codes.reshape(n, k // 2, 2).unbind(-1)
        nibbles = (even << 4 | odd).to(torch.uint8)  # an even input in the high nibble, as tinygemm's packer reads
        weight = torch.ops.aten._convert_weight_to_int4pack(nibbles.contiguous(), inner_k_tiles(k))
        dtype = dtype or torch.bfloat16
    else:
        weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        dtype = dtype or torch.float32
    scale = scales.float()
    zero = scale * (8 - zeros.float())
    scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()
    return Int4Pack(weight, scales_and_zeros, group_size, k, n)


def gptq_parts(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
               group_size: int, zero_offset: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 4-bit GPTQ linear's stored tensors as (codes [n, k], scales [n, groups], zero points [n, groups]); the zero
    points are the stored ones plus `zero_offset` (1 for v1 checkpoints, added to each packed word as GPTQModel does
    when it loads one). ValueError unless the groups are static (g_idx[i] = i // group_size, which desc_act
    permutes) and divide the inputs."""
    k, groups = g_idx.numel(), scales.shape[0]
    if groups * group_size != k or not torch.equal(g_idx.long(), torch.arange(k) // group_size):
        raise ValueError(f"g_idx is not static {group_size}-wide groups over {k} inputs (desc_act, or a ragged "
                         "last group): the int4pack kernels take static groups only")
    codes = unpack_rows(qweight, 4)[:k].t()
    words = (qzeros.long() + zero_offset * V1_ZERO_WORD) & 0xFFFFFFFF  # as GPTQModel loads v1: borrows undone
    zeros = unpack_rows(words.t().contiguous(), 4).t()[:, : scales.shape[1]]
    return codes.contiguous(), scales.t().contiguous(), zeros.t().contiguous()


class Int4Linear(nn.Module):
    """Inference-only stand-in for a GPTQ linear: one call of torch's int4 kernel for its device (CUDA tinygemm on
    bf16 activations, the CPU kernel on float32 ones), the output cast back to the input's dtype."""

    def __init__(self, packed: Int4Pack, bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.group_size = packed.group_size
        # a device's layout, not a checkpoint's: out of the state_dict
        self.register_buffer("weight_int4pack", packed.weight, persistent=False)
        self.register_buffer("scales_and_zeros", packed.scales_and_zeros, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.sibling: tuple[Any, int] | None = None  # (SiblingGroup, index), set by decode.backends.siblings

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sibling is not None:
            out = self.sibling[0].output(self.sibling[1], x)
            if out is not None:
                return out
        flat = x.reshape(-1, self.in_features).to(self.scales_and_zeros.dtype).contiguous()
        if flat.device.type == "cuda":
            out = torch.ops.aten._weight_int4pack_mm(flat, self.weight_int4pack, self.group_size,
                                                     self.scales_and_zeros)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.weight_int4pack, self.group_size,
                                                             self.scales_and_zeros)
        out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"


def dequantized(linear: Int4Linear) -> torch.Tensor:
    """The [out, in] float32 weight a CPU Int4Linear computes with, read back through its own kernel."""
    eye = torch.eye(linear.in_features, dtype=linear.scales_and_zeros.dtype)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, linear.weight_int4pack, linear.group_size,
                                                     linear.scales_and_zeros)
    return out.float().t().contiguous()


def is_int4pack(model: nn.Module) -> bool:
    """Whether `model` runs its quantized linears as Int4Linear (built by load_int4pack)."""
    return any(isinstance(m, Int4Linear) for m in model.modules())


def is_gptq_folder(folder: Path) -> bool:
    """Whether `folder` holds a GPTQ checkpoint (its config.json's quantization_config says so)."""
    config = folder / "config.json"
    if not config.is_file():
        return False
    quant = json.loads(config.read_text()).get("quantization_config") or {}
    return quant.get("quant_method") == "gptq"


def quantization_problem(quant: dict) -> str | None:
    """Why a checkpoint's quantization_config is not one the int4pack level takes, or None."""
    if quant.get("quant_method") != "gptq" or quant.get("bits") != 4:
        return f"quantization {quant.get('quant_method')} bits={quant.get('bits')}: only 4-bit GPTQ"
    if quant.get("desc_act"):
        return "desc_act: true (activation order): only static groups (desc_act: false)"
    fmt = quant.get("checkpoint_format", "gptq")
    if fmt not in ZERO_OFFSET:
        return f"checkpoint_format {fmt}: only {', '.join(ZERO_OFFSET)}"
    return None


def load_int4pack(folder: str | Path, dtype: str = "float32", device: torch.device | str = "cpu",
                  kernel_dtype: torch.dtype | None = None) -> PreTrainedModel:
    """The GPTQ checkpoint in `folder` as a model on `device`: its float tensors in `dtype` on the model's own
    skeleton, every quantized linear an Int4Linear whose scales and zeros are in `kernel_dtype` (None: the device's,
    see `pack`; bf16 on a CPU runs CUDA's arithmetic there). ValueError (one line) for a checkpoint it cannot take."""
    folder, device, torch_dtype = Path(folder), torch.device(device), getattr(torch, dtype)
    config = AutoConfig.from_pretrained(folder)
    quant = getattr(config, "quantization_config", None) or {}
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    problem = quantization_problem(quant)
    if problem is not None:
        raise ValueError(f"{folder}: {problem}")
    plain = copy.deepcopy(config)
    del plain.quantization_config
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(plain, dtype=torch_dtype).eval()
    model.config.quantization_config = quant  # still a W4 model to every reader of its config
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors |= load_file(file)
    offset = ZERO_OFFSET[quant.get("checkpoint_format", "gptq")]
    for prefix in sorted(key.removesuffix(".qweight") for key in tensors if key.endswith(".qweight")):
        stored = [tensors.pop(f"{prefix}.{part}") for part in GPTQ_PARTS]
        try:
            parts = gptq_parts(*stored, quant["group_size"], offset)
            packed = pack(*(part.to(device) for part in parts), quant["group_size"], kernel_dtype)
        except ValueError as err:
            raise ValueError(f"{folder}: {prefix}: {err}") from None
        bias = tensors.pop(f"{prefix}.bias", None)
        parent, _, name = prefix.rpartition(".")
        linear = Int4Linear(packed, None if bias is None else bias.to(device, torch_dtype))
        model.get_submodule(parent).register_module(name, linear)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [key for key in missing if not (key.endswith("lm_head.weight") and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"{folder}: the checkpoint does not fit its config (missing {missing[:3]}, unexpected "
                         f"{unexpected[:3]})")
    return model
