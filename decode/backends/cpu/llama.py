"""A native runner for GPTQ W4 Llama-family models (Llama, Qwen2, Mistral, SmolLM): the whole decoder forward
in one C++ call (decode/backends/cpu/llama_w4.cpp), with int4 dequantization fused into the weight stream and a
preallocated KV cache whose rollback is setting a length.

The eager HF forward of a small W4 model costs more than its fp32 target although it reads a seventh of the
bytes: the time goes to thousands of small aten ops per forward, not to the weights (BENCHMARKS.md). The native
forward computes the same W4 model (GPTQModel's CPU kernel's weights: (q - 8) * scale, bf16 scales) with fp32
activations instead of bf16 ones, so its logits agree with GPTQModel's within bf16 rounding, not bit for bit; each
row is one fixed sequence of operations, so a k-token forward gives the bits of k one-token forwards.

Activations (`activations`): "int8" quantizes each row per 16 inputs to int8 and multiplies with integer dot
products (W4A8, the default: bound by memory at one token and cheap at eight); "fp32" computes exactly the fp32
product with the dequantized weights (slower; agreement studies). Either way a row's bits do not depend on the
other rows or the thread count.

`unsupported(model)` says why a model cannot run here (the builder then keeps the eager HF path), None if it can.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from decode.backends.cpu.kernels import build_extension

ARCHITECTURES = ("llama", "qwen2", "mistral")
STATIC_ROPE = ("default", "linear", "llama3")  # rotary tables that depend on the position only
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
KERNELS_CPP = Path(__file__).with_name("kernels.cpp")
MAX_CAPACITY = 8192  # positions a runner's cache may hold (rotary tables are built up to it)


ACTIVATIONS = ("int8", "fp32")


def _has_avx512_vnni() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return torch.backends.cpu.get_cpu_capability() == "AVX512" and {"avx512bw", "avx512_vnni"} <= set(flags)


@functools.cache
def native_kernels() -> tuple[Any | None, str]:
    """(the llama_w4.cpp extension for this machine, "") or (None, why not); AVX-512 where the CPU has its BW and
    VNNI parts, else AVX2."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None, f"the CPU lacks AVX2+FMA ({torch.backends.cpu.get_cpu_capability()})"
    wide = ["-mavx512f", "-mavx512bw", "-mavx512vnni"] if _has_avx512_vnni() else []
    return build_extension("polyspec_llama_w4", Path(__file__).with_name("llama_w4.cpp"),
                           ["-O3", "-mavx2", "-mfma", "-fopenmp", *wide], (KERNELS_CPP,))


def _module(model: torch.nn.Module, layer: int, name: str) -> torch.nn.Module:
    return model.get_submodule(f"model.layers.{layer}.{name}")


def _config_problem(config: PretrainedConfig) -> str | None:
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if config.model_type not in ARCHITECTURES:
        return f"architecture {config.model_type!r} is not one of {', '.join(ARCHITECTURES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} is not silu"
    if rope_type not in STATIC_ROPE:
        return f"rope type {rope_type!r} is not one of {', '.join(STATIC_ROPE)}"
    if getattr(config, "mlp_bias", False):
        return "the MLP has biases"
    if getattr(config, "use_sliding_window", config.model_type == "mistral") and getattr(config, "sliding_window", None):
        return "sliding-window attention"
    return None


def _quantization(config: PretrainedConfig) -> dict:
    quant = getattr(config, "quantization_config", None) or {}
    return quant if isinstance(quant, dict) else quant.to_dict()


def _symmetric(module: torch.nn.Module) -> bool:
    """Zero points all 8, as GPTQModel's CPU kernel assumes (unknown once it has repacked: then it is its weight)."""
    if module.linear_mode is not None:
        return True
    from quantize.w4 import unpack_rows

    return bool((unpack_rows(module.qzeros.t().contiguous(), 4) == 8).all())


def _linear_problem(module: torch.nn.Module, name: str) -> str | None:
    if type(module).__name__ != "TorchFusedLinear" or not hasattr(module, "transform"):
        return f"{name} is {type(module).__name__}, not GPTQModel's CPU int4 linear (TorchFusedLinear)"
    if module.bits != 4 or module.qweight.device.type != "cpu" or not _symmetric(module):
        return f"{name}: the kernel takes symmetric 4-bit CPU weights (zero point 8)"
    if getattr(module, "adapter", None) is not None:
        return f"{name} has an adapter"
    if module.in_features % 16 or module.group_size % 16:
        return f"{name}: input width {module.in_features} and group size {module.group_size} must be multiples of 16"
    return None


def unsupported(model: torch.nn.Module) -> str | None:
    """Why `model` cannot run natively here, or None: a Llama-family causal LM whose every decoder linear is a
    symmetric 4-bit GPTQ one (MLP bias-free), static rotary scaling, no sliding window, and kernels that build."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "model") or not hasattr(model.model, "layers"):
        return "not a transformers decoder-only model"
    quant = _quantization(config)
    problem = _config_problem(config)
    if quant.get("bits") != 4 or quant.get("sym") is not True:
        problem = problem or f"quantization {quant.get('quant_method')} bits={quant.get('bits')} sym={quant.get('sym')}: not symmetric 4-bit"
    for layer in range(config.num_hidden_layers):
        for name in LINEARS:
            problem = problem or _linear_problem(_module(model, layer, name), f"layer {layer} {name}")
    if problem is None and getattr(model.get_input_embeddings(), "weight", None) is None:
        problem = "no input embedding weight"
    return problem or (native_kernels()[1] or None)


def _inference_layout(module: torch.nn.Module) -> None:
    """GPTQModel's own first-inference repack (int4pack layout, act-order index, bf16 scales), if not yet done."""
    if module.linear_mode is None:
        from gptqmodel.looper.linear_mode import LinearMode

        module.transform(torch.bfloat16, "cpu")
        module.linear_mode = LinearMode.INFERENCE


@torch.no_grad()
def int4_parts(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [N, K] 0..15 with inputs in act order, scales [N, groups] float32 (GPTQModel's bf16 values), the
    act-order input index [K]) of a TorchFusedLinear: the weight GPTQModel's CPU kernel uses, (code - 8) * scale
    with inputs k' // group_size sharing a scale. The codes are read back through that kernel (scale 1, zero 8)."""
    _inference_layout(module)
    k, groups = module.in_features, module.scales.shape[0]
    unit = torch.stack([torch.ones(groups, module.out_features), torch.full((groups, module.out_features), 8.0)], -1)
    codes = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.eye(k, dtype=torch.bfloat16), module.qweight,
                                                       module.group_size, unit.to(torch.bfloat16))
    return codes.t().to(torch.uint8).contiguous(), module.scales.float().t().contiguous(), module.ret_idx.long()


def _weight(kernels: Any, modules: list[torch.nn.Module], activations: str) -> tuple:
    """Sibling int4 linears (same input, same act order) as one kernel weight: their outputs side by side, packed
    for int8 or fp32 activations."""
    parts = [int4_parts(m) for m in modules]
    codes, scales, perm = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), parts[0][2]
    pack = kernels.pack_int4_a8 if activations == "int8" else kernels.pack_int4
    words, panel_scales = pack(codes, scales)
    k, size = codes.shape[1], modules[0].group_size
    bounds = torch.tensor([*range(0, k, size), k], dtype=torch.long)
    identity = torch.equal(perm, torch.arange(k))
    biases = [m.bias.float() if m.bias is not None else torch.zeros(m.out_features) for m in modules]
    bias = torch.cat(biases) if any(m.bias is not None for m in modules) else torch.empty(0)
    return words, panel_scales, bounds, torch.empty(0, dtype=torch.long) if identity else perm, bias, codes.shape[0]


def _siblings(kernels: Any, modules: list[torch.nn.Module], activations: str) -> list[tuple]:
    """One fused weight when the siblings share their act order and group size, else one weight each."""
    for m in modules:
        _inference_layout(m)
    first = modules[0]
    if all(torch.equal(m.ret_idx, first.ret_idx) and m.group_size == first.group_size for m in modules):
        return [_weight(kernels, modules, activations)]
    return [_weight(kernels, [m], activations) for m in modules]


def _rotary(model: torch.nn.Module, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's own cos/sin tables [capacity, head dim] for positions 0 .. capacity - 1 (scaling included)."""
    positions = torch.arange(capacity)[None]
    with torch.no_grad():
        cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
    return cos[0].float().contiguous(), sin[0].float().contiguous()


def native_model(model: torch.nn.Module, activations: str = "int8") -> Any:
    """The C++ decoder with `model`'s weights (int4 repacked once per activation type, norms and embeddings
    shared), kept on the model: every runner of the model (one per chain) shares it and brings its own cache."""
    key = f"_native_w4_{activations}"
    if key not in vars(model):
        capacity = min(MAX_CAPACITY, getattr(model.config, "max_position_embeddings", MAX_CAPACITY))
        vars(model)[key] = (_native_model(model, capacity, activations), capacity)
    return vars(model)[key]


def _native_model(model: torch.nn.Module, capacity: int, activations: str) -> Any:
    kernels, config = native_kernels()[0], model.config
    attention = model.model.layers[0].self_attn
    cos, sin = _rotary(model, capacity)
    native = kernels.LlamaW4(model.get_input_embeddings().weight.detach(), model.model.norm.weight.detach().float(), cos, sin,
                             config.num_attention_heads, config.num_key_value_heads, config.rms_norm_eps,
                             config.num_hidden_layers)
    assert cos.shape[1] == attention.head_dim
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        native.add_layer(layer.input_layernorm.weight.detach().float(), layer.post_attention_layernorm.weight.detach().float(),
                         _siblings(kernels, [a.q_proj, a.k_proj, a.v_proj], activations),
                         _weight(kernels, [a.o_proj], activations), _siblings(kernels, [m.gate_proj, m.up_proj], activations),
                         _weight(kernels, [m.down_proj], activations))
    return native


class NativeLlamaRunner:
    """A W4 Llama-family decoder with its own KV cache (the Runner a ModelLevel drives): forward appends after
    the cached positions and returns the final-norm hidden states; the LM head stays the level's."""

    def __init__(self, model: torch.nn.Module, capacity: int | None = None, activations: str = "int8"):
        """`capacity`: the positions its KV cache holds (None: the model's maximum, up to MAX_CAPACITY; the memory
        is allocated, not touched, until used); `activations`: int8 | fp32 (the module's docstring)."""
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
        problem = unsupported(model)
        if problem is not None:
            raise ValueError(f"the native W4 runner cannot run this model: {problem}")
        self.config: PretrainedConfig = model.config
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.native, most = native_model(model, activations)
        self.capacity = most if capacity is None else min(capacity, most)
        config = model.config
        shape = (config.num_hidden_layers, config.num_key_value_heads, self.capacity, self.native.head_dim())
        self.keys, self.values = torch.empty(shape), torch.empty(shape)  # positions >= length are never read
        self.length = 0
        self.layers: list[int] = []
        self.captured: torch.Tensor | None = None

    def capture(self, layers: tuple[int, ...]) -> None:
        """Every later forward also leaves the states entering these layers in `captured` (EAGLE-3's aux states)."""
        self.layers = [int(i) for i in layers]

    def cached(self) -> int:
        return self.length

    def crop(self, length: int) -> None:
        """Forget positions >= length."""
        self.length = min(self.length, max(0, length))

    def keep(self, index: torch.Tensor) -> None:
        """Keep only these cached positions, in this order (an accepted tree path)."""
        index = index.to(torch.long)
        if index.numel() and (index.min() < 0 or index.max() >= self.length):
            raise IndexError(f"keep: positions must lie in [0, {self.length})")
        moved = index != torch.arange(index.numel())
        first = int(moved.nonzero()[0]) if moved.any() else index.numel()  # the context before the tree stays put
        for cache in (self.keys, self.values):
            cache[:, :, first:index.numel()] = cache[:, :, index[first:]]
        self.length = index.numel()

    def reset(self) -> None:
        self.length = 0

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """ids [1, T] after the cached positions; mask None (causal) or additive [1, 1, T, cached + T]; positions
        None (cached .. cached + T - 1) or [1, T]. Returns [1, T, hidden] float32."""
        t = ids.shape[-1]
        if self.length + t > self.capacity:
            raise ValueError(f"the native W4 runner's cache holds {self.capacity} positions; {self.length + t} asked")
        if positions is None:
            positions = torch.arange(self.length, self.length + t)
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.float()
        aux = torch.empty(t, len(self.layers) * self.config.hidden_size) if self.layers else None
        hidden = self.native.forward(ids.reshape(-1), positions.reshape(-1).long().contiguous(), mask, self.length,
                                     self.keys, self.values, aux, self.layers)
        self.captured = None if aux is None else aux[None]
        self.length += t
        return hidden[None]


class NativeInt8Head(torch.nn.Module):
    """An int8 LM head (decode.backends.cpu.int8.Int8RowLinear's weights: int8 rows, one bf16 scale each) on the native
    kernel with int8 activations (each row quantized per 16 inputs, as the native runner's int8 activations are):
    integer dot products, where aten's int8 kernel takes bf16 activations. Inference only; the original weight stays
    attached."""

    def __init__(self, head: torch.nn.Module):
        super().__init__()
        self.out_features, self.in_features = head.qweight.shape
        self.weight, self.bias = head.weight, None
        self.words, self.scales = native_kernels()[0].pack_int8(head.qweight, head.scales.float())
        self.bounds = torch.tensor([0, self.in_features])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        out = native_kernels()[0].quant_mm(flat, self.words, self.scales, self.bounds, None, self.out_features, None)
        return out.reshape(*x.shape[:-1], self.out_features)
