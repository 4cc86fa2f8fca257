"""A native runner for Llama-family models (Llama, Qwen2, Mistral, SmolLM): the whole decoder forward in one C++
call (decode/backends/cpu/decoder.cpp) with a preallocated KV cache whose rollback is setting a length. One layer
loop serves two kinds of weights: fp32 (a chain's target, on decode.fast's packed avx2 panels, shared with the
model's packed linears) and GPTQ W4 (by default on int8 activations and integer dot products; see "Activations").

Eager PyTorch spends much of a small model's forward outside its weights: thousands of small aten ops per forward
(BENCHMARKS.md). Every row of a native forward is one fixed sequence of operations, so a k-token forward gives the
bits of k one-token forwards (row-exact verification, trees included).

fp32: the native forward is not HF's bit for bit (its norms, rotary and SiLU round differently), so it is a
*configuration* of the target, as packing is: the backend's `Prepared` target gives native runners to a chain's
target level and the AR reference alike (`native_fp32_runner`); lossless means equal to AR on the same forward.

W4: the native forward computes the same W4 model as GPTQModel's CPU kernel ((q - 8) * scale, bf16 scales) with fp32
activations instead of bf16 ones, so its logits agree with GPTQModel's within bf16 rounding, not bit for bit.
Activations (`activations`): "int8" quantizes each row per 16 inputs to int8 and multiplies with integer dot
products (W4A8, the default: bound by memory at one token and cheap at eight); "fp32" computes exactly the fp32
product with the dequantized weights (slower; agreement studies).

`unsupported(model)` says why a model cannot run here (the builder then keeps the eager HF path), None if it can.
"""
from __future__ import annotations

import functools
import sys
import weakref
from typing import Any, Callable

import torch
from transformers import PretrainedConfig

from decode.backends.cpu.dense import PackedLinear, pack_weight
from decode.backends.cpu.fusion import StackedProduct
from infra.hugepages import in_huge_pages
from decode.backends.cpu.kernels import HERE, KERNEL_SOURCES, build_extension, build_flags, kernel_ops

ARCHITECTURES = ("llama", "qwen2", "mistral")
STATIC_ROPE = ("default", "linear", "llama3")  # rotary tables that depend on the position only
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
MAX_CAPACITY = 8192  # positions a runner's cache may hold (rotary tables are built up to it)
ACTIVATIONS = ("int8", "fp32")
# model -> {weight kind: (native decoder, capacity)}: weak, so that a deep copy (an early-exit level) builds its own
_NATIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@functools.cache
def native_kernels() -> tuple[Any | None, str]:
    """(the native decoder's extension for this machine, "") or (None, why not): decoder.cpp and what it runs on
    (packed_linear.cpp, pack.cpp, kernels.cpp), with decoder_module.cpp; AVX-512 where the CPU has its BW and VNNI
    parts, else AVX2."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None, f"the CPU lacks AVX2+FMA ({torch.backends.cpu.get_cpu_capability()})"
    return build_extension("polyspec_decoder", (*KERNEL_SOURCES, HERE / "decoder.cpp", HERE / "decoder_module.cpp"),
                           build_flags())


def stream_kernel() -> tuple[Callable[[torch.Tensor], float] | None, str]:
    """(the read-bandwidth probe `stream_sum` of this machine's kernel build, its name) for
    infra.timing.read_bandwidth, or (None, why not)."""
    ops, why = kernel_ops()
    if ops is None:
        return None, why
    return ops.stream_sum, f"stream_sum {'avx512' if ops.lanes() == 16 else 'avx2'}"


def _module(model: torch.nn.Module, layer: int, name: str) -> torch.nn.Module:
    return model.get_submodule(f"model.layers.{layer}.{name}")


def config_problem(config: PretrainedConfig) -> str | None:
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
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if head_dim % 8 or head_dim > 256 or heads % kv_heads:
        return (f"head dim {head_dim}, {heads} heads over {kv_heads} K/V heads: attention takes head dims that are "
                "multiples of 8 up to 256, and query heads a multiple of K/V heads")
    sliding = getattr(config, "use_sliding_window", config.model_type == "mistral")
    if sliding and getattr(config, "sliding_window", None):
        return "sliding-window attention"
    return None


def _quantization(config: PretrainedConfig) -> dict:
    quant = getattr(config, "quantization_config", None) or {}
    return quant if isinstance(quant, dict) else quant.to_dict()


def _symmetric(module: torch.nn.Module) -> bool:
    """Zero points all 8, as GPTQModel's CPU kernel assumes (unknown once it has repacked: then it is its weight)."""
    if module.linear_mode is not None:
        return True
    from quantize.checkpoint import unpack_rows

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


def dense_problem(module: torch.nn.Module, name: str) -> str | None:
    if isinstance(module, PackedLinear):
        return None if module.gemm == "avx2" else f"{name} is packed for {module.gemm}, not the avx2 product"
    if type(module) is not torch.nn.Linear:
        return f"{name} is {type(module).__name__}, not an nn.Linear"
    if module.weight.dtype != torch.float32 or module.weight.device.type != "cpu":
        return f"{name}: the kernel takes float32 CPU weights, not {module.weight.dtype} on {module.weight.device}"
    return None


def is_quantized(model: torch.nn.Module) -> bool:
    """A quantized checkpoint (a W4 copy), as opposed to a plain fp32 model."""
    return bool(_quantization(model.config))


def unsupported(model: torch.nn.Module) -> str | None:
    """Why `model` cannot run natively here, or None: a Llama-family causal LM (static rotary scaling, no sliding
    window, MLP bias-free) whose every decoder linear is a symmetric 4-bit GPTQ one, or a float32 one (plain, or
    packed for the avx2 product), and kernels that build."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "model") or not hasattr(model.model, "layers"):
        return "not a transformers decoder-only model"
    problem, quant = config_problem(config), _quantization(config)
    if quant and (quant.get("bits") != 4 or quant.get("sym") is not True):
        problem = problem or (f"quantization {quant.get('quant_method')} bits={quant.get('bits')} "
                              f"sym={quant.get('sym')}: not symmetric 4-bit")
    linear_problem = _linear_problem if quant else dense_problem
    for layer in range(config.num_hidden_layers):
        for name in LINEARS:
            problem = problem or linear_problem(_module(model, layer, name), f"layer {layer} {name}")
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


def kernel_weight(kernels: Any, words: torch.Tensor, scales: torch.Tensor | None = None, **parts: Any) -> Any:
    """A PackedWeight built from a packer's final output, its streamed parts (words, scales) copied into huge pages
    (infra.hugepages); `parts`: its n, bounds, perm, bias."""
    placed = None if scales is None else in_huge_pages(scales)
    return kernels.PackedWeight(words=in_huge_pages(words), scales=placed, **parts)


def int4_weight(kernels: Any, parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], group_size: int,
                activations: str, bias: torch.Tensor | None = None) -> Any:
    """int4 parts as `int4_parts` gives them (codes [N, K], one scale per output and group of `group_size` inputs
    [N, G], the act order: None or the identity for none) as one kernel weight, packed for int8 or fp32 activations."""
    codes, scales, perm = parts
    pack = kernels.pack_int4_a8 if activations == "int8" else kernels.pack_int4
    words, panel_scales = pack(codes, scales)
    k = codes.shape[1]
    bounds = torch.tensor([*range(0, k, group_size), k], dtype=torch.long)
    identity = perm is None or torch.equal(perm, torch.arange(k))
    return kernel_weight(kernels, words, panel_scales, n=codes.shape[0], bounds=bounds,
                         perm=None if identity else perm, bias=bias)


def _w4_weight(kernels: Any, modules: list[torch.nn.Module], activations: str) -> Any:
    """Sibling int4 linears (same input, same act order) as one kernel weight: their outputs side by side, packed
    for int8 or fp32 activations."""
    parts = [int4_parts(m) for m in modules]
    codes, scales, perm = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), parts[0][2]
    biases = [m.bias.float() if m.bias is not None else torch.zeros(m.out_features) for m in modules]
    bias = torch.cat(biases) if any(m.bias is not None for m in modules) else None
    return int4_weight(kernels, (codes, scales, perm), modules[0].group_size, activations, bias)


def w4_siblings(kernels: Any, modules: list[torch.nn.Module], activations: str) -> list[Any]:
    """One fused weight when the siblings share their act order and group size, else one weight each."""
    for m in modules:
        _inference_layout(m)
    first = modules[0]
    if all(torch.equal(m.ret_idx, first.ret_idx) and m.group_size == first.group_size for m in modules):
        return [_w4_weight(kernels, modules, activations)]
    return [_w4_weight(kernels, [m], activations) for m in modules]


def dense_weight(kernels: Any, modules: list[torch.nn.Module]) -> Any:
    """fp32 linears (siblings: same input) as one kernel weight, outputs side by side, packed here."""
    weight = torch.cat([m.weight.detach() for m in modules])
    bias = None
    if any(m.bias is not None for m in modules):
        bias = torch.cat([m.bias.detach() if m.bias is not None else weight.new_zeros(m.out_features) for m in modules])
    return kernel_weight(kernels, pack_weight(weight, "avx2").data, n=weight.shape[0], bias=bias)


def int8_weight(kernels: Any, modules: list[torch.nn.Module]) -> Any:
    """Bias-free linears (siblings: same input) as one weight of int8 rows (decode.backends.cpu.int8.int8_rows), run
    on int8 activations: a drafter's weights at a quarter of their fp32 bytes."""
    from decode.backends.cpu.int8 import int8_rows

    rows, scales = int8_rows(torch.cat([m.weight.detach() for m in modules]))
    words, panel_scales = kernels.pack_int8(rows, scales)
    return kernel_weight(kernels, words, panel_scales, bounds=torch.tensor([0, rows.shape[1]]), n=rows.shape[0])


def _shared_weight(kernels: Any, module: torch.nn.Module) -> Any:
    """One fp32 linear as a kernel weight: its avx2 panels from decode.fast, shared, or packed here."""
    if not isinstance(module, PackedLinear) or module.packed is None:
        return dense_weight(kernels, [module])
    bias = None if module.bias is None else module.bias.detach()
    return kernels.PackedWeight(words=module.packed.data, n=module.out_features, bias=bias)


def _dense_siblings(kernels: Any, modules: list[torch.nn.Module]) -> list[Any]:
    """Sibling fp32 linears as kernel weights: the stacked panels decode.fast runs them on as one product (shared,
    not copied), else each one's own panels, else (a plain model) one stacked weight packed here."""
    first = getattr(modules[0], "sibling", None)
    group = first[0] if first is not None else None
    if (group is not None and len(group.bounds) == len(modules) + 1 and isinstance(group.run, StackedProduct)
            and all(getattr(m, "sibling", None) == (group, i) for i, m in enumerate(modules))):
        return [kernels.PackedWeight(words=group.run.packed.data, n=group.bounds[-1], bias=group.run.bias)]
    if all(isinstance(m, PackedLinear) and m.packed is not None for m in modules):
        return [_shared_weight(kernels, m) for m in modules]
    return [dense_weight(kernels, modules)]


def rotary_tables(rotary: Callable, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's own cos/sin tables [capacity, head dim] for positions 0 .. capacity - 1 (scaling included), from a rotary
    embedding called as (x, positions)."""
    positions = torch.arange(capacity)[None]
    with torch.no_grad():
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    return cos[0].float().contiguous(), sin[0].float().contiguous()


def layer_weights(kernels: Any, layer: torch.nn.Module, activations: str | None,
                  int8: bool = False) -> tuple[list, Any, list, Any]:
    """A decoder layer's (q/k/v, o, gate/up, down) as kernel weights: W4 ones on int8 or fp32 `activations`, or
    with None fp32 ones (`int8`: int8 rows of them, on int8 activations)."""
    a, m = layer.self_attn, layer.mlp
    qkv, gate_up = [a.q_proj, a.k_proj, a.v_proj], [m.gate_proj, m.up_proj]
    if activations is None and int8:
        return ([int8_weight(kernels, qkv)], int8_weight(kernels, [a.o_proj]), [int8_weight(kernels, gate_up)],
                int8_weight(kernels, [m.down_proj]))
    if activations is None:
        return (_dense_siblings(kernels, qkv), _shared_weight(kernels, a.o_proj), _dense_siblings(kernels, gate_up),
                _shared_weight(kernels, m.down_proj))
    return (w4_siblings(kernels, qkv, activations), _w4_weight(kernels, [a.o_proj], activations),
            w4_siblings(kernels, gate_up, activations), _w4_weight(kernels, [m.down_proj], activations))


def native_model(model: torch.nn.Module, activations: str = "int8") -> tuple[Any, int]:
    """(the C++ decoder with `model`'s weights, its capacity), made once per model and weight kind (int4 repacked
    once per activation type; fp32 panels, norms and embeddings shared): every runner of the model (one per chain)
    shares it and brings its own cache."""
    kind = f"w4 {activations}" if is_quantized(model) else "fp32"
    built = _NATIVE.setdefault(model, {})
    if kind not in built:
        capacity = min(MAX_CAPACITY, getattr(model.config, "max_position_embeddings", MAX_CAPACITY))
        built[kind] = (_native_model(model, capacity, activations), capacity)
    return built[kind]


def _native_model(model: torch.nn.Module, capacity: int, activations: str) -> Any:
    kernels, config = native_kernels()[0], model.config
    cos, sin = rotary_tables(model.model.rotary_emb, capacity)
    assert cos.shape[1] == model.model.layers[0].self_attn.head_dim
    native = kernels.Decoder(model.get_input_embeddings().weight.detach(), model.model.norm.weight.detach().float(),
                             cos, sin, config.num_attention_heads, config.num_key_value_heads, config.rms_norm_eps,
                             config.num_hidden_layers)
    for layer in model.model.layers:
        native.add_layer(layer.input_layernorm.weight.detach().float(),
                         layer.post_attention_layernorm.weight.detach().float(),
                         *layer_weights(kernels, layer, activations if is_quantized(model) else None))
    return native


class NativeCache:
    """A native decoder's KV cache, the part its runners share: preallocated for `capacity` positions (allocated, not
    touched, until used) and rolled back by setting its length."""

    def __init__(self, layers: int, kv_heads: int, capacity: int, head_dim: int):
        shape = (layers, kv_heads, capacity, head_dim)
        self.keys, self.values = torch.empty(shape), torch.empty(shape)  # positions >= length are never read
        self.capacity, self.length = capacity, 0

    def cached(self) -> int:
        return self.length

    def crop(self, length: int) -> None:
        """Forget positions >= length."""
        self.length = min(self.length, max(0, length))

    def reset(self) -> None:
        self.length = 0

    def cached_bytes(self) -> int:
        """The bytes of the keys and values cached so far (what a forward reads of them)."""
        cached = self.keys.narrow(2, 0, self.length)
        return 2 * cached.numel() * cached.element_size()

    def positions(self, t: int, positions: torch.Tensor | None) -> torch.Tensor:
        """The positions of `t` new tokens (None: cached .. cached + t - 1) as the decoder takes them; a ValueError
        where the cache cannot hold them."""
        if self.length + t > self.capacity:
            raise ValueError(f"the native cache holds {self.capacity} positions; {self.length + t} asked")
        if positions is None:
            positions = torch.arange(self.length, self.length + t)
        return positions.reshape(-1).long().contiguous()


class NativeLlamaRunner(NativeCache):
    """A Llama-family decoder (fp32 or W4) with its own KV cache (the Runner a ModelLevel drives): forward appends
    after the cached positions and returns the final-norm hidden states; the LM head stays the level's."""

    def __init__(self, model: torch.nn.Module, capacity: int | None = None, activations: str = "int8"):
        """`capacity`: the positions its KV cache holds (None: the model's maximum, up to MAX_CAPACITY; the memory
        is allocated, not touched, until used); `activations`: a W4 model's, int8 | fp32 (the module's docstring)."""
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
        problem = unsupported(model)
        if problem is not None:
            raise ValueError(f"the native runner cannot run this model: {problem}")
        self.config: PretrainedConfig = model.config
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.native, most = native_model(model, activations)
        config = model.config
        super().__init__(config.num_hidden_layers, config.num_key_value_heads,
                         most if capacity is None else min(capacity, most), self.native.head_dim())
        self.layers: list[int] = []
        self.captured: torch.Tensor | None = None

    def streamed_bytes(self) -> int:
        """The bytes a one-token forward reads now, from the buffers it runs on: the decoder's packed weights and norms
        (its own count) and the keys and values cached so far (an embedding row and rotary row per token aside)."""
        return self.native.weight_bytes() + self.cached_bytes()

    def capture(self, layers: tuple[int, ...]) -> None:
        """Every later forward also leaves the states entering these layers in `captured` (EAGLE-3's aux states)."""
        self.layers = [int(i) for i in layers]

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

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """ids [1, T] after the cached positions; mask None (causal) or additive [1, 1, T, cached + T]; positions
        None (cached .. cached + T - 1) or [1, T]. Returns [1, T, hidden] float32."""
        t = ids.shape[-1]
        positions = self.positions(t, positions)
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.float()
        aux = torch.empty(t, len(self.layers) * self.config.hidden_size) if self.layers else None
        hidden = self.native.forward(ids.reshape(-1), positions, mask, self.length,
                                     self.keys, self.values, aux, self.layers)
        self.captured = None if aux is None else aux[None]
        self.length += t
        return hidden[None]


def native_fp32_runner(model: torch.nn.Module, native: str) -> Callable[[], NativeLlamaRunner] | None:
    """New native runners of an fp32 model, per `native`: "auto" where it can run (else None, and why on stderr),
    "on" (a ValueError where it cannot), "off" (None)."""
    _NATIVE.pop(model, None)  # weights may have changed since a decoder was built
    if native == "off":
        return None
    problem = "a quantized model (its runner is chosen per level)" if is_quantized(model) else unsupported(model)
    if problem is None:
        return functools.partial(NativeLlamaRunner, model)
    if native == "on":
        raise ValueError(f"native_fp32=on: the native runner cannot run {model.name_or_path}: {problem}")
    print(f"decode: {model.name_or_path} runs the HF forward (native runner: {problem})", file=sys.stderr)
    return None


class NativeInt8Linear(torch.nn.Module):
    """A bias-free linear on int8 rows (decode.backends.cpu.int8.Int8RowLinear's weights: one bf16 scale each) on the
    native kernel with int8 activations (each row quantized per 16 inputs, as the native runner's int8 activations
    are): integer dot products, where aten's int8 kernel takes bf16 activations. A drafting level's LM head, an EAGLE
    head's fc. Inference only; the original weight stays attached."""

    def __init__(self, head: torch.nn.Module):
        super().__init__()
        self.out_features, self.in_features = head.qweight.shape
        self.weight, self.bias = head.weight, None
        kernels = native_kernels()[0]
        words, scales = kernels.pack_int8(head.qweight, head.scales.float())
        self.packed = kernel_weight(kernels, words, scales, bounds=torch.tensor([0, self.in_features]),
                                    n=self.out_features)

    def streamed_bytes(self) -> int:
        """The bytes a forward reads: the packed int8 rows and their scales."""
        return self.packed.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        out = native_kernels()[0].packed_mm(flat, self.packed)
        return out.reshape(*x.shape[:-1], self.out_features)
