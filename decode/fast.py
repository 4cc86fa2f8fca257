"""Fast CPU forwards for any HF causal LM: every `nn.Linear` runs on a weight packed once.

On this project's CPUs a forward of a small model is almost all small-M matrix products (1-16 new
tokens against 0.5-50k-wide weights). PyTorch's default fp32 path (MKL sgemm) re-packs the weight on
every call and, for a few rows, runs far below the machine's rate: measured on a 2-core AMD EPYC, a
576->49,152 LM head takes 26 ms for 8 rows through `F.linear` and 7.4 ms through oneDNN with the
weight packed ahead of time; a 576->1536 projection 0.28 ms vs 0.15 ms.

Two packed products (`gemm`): `avx2`, this project's kernel (decode/kernels.cpp: 8-column weight panels, 4 x 3
register tiles, three weight streams per thread), compiled on first use for the machine and cached under
the project's cache dir; and `onednn`, torch's prepacked oneDNN linear. `auto` takes avx2 wherever it builds
(an x86 CPU with AVX2 and FMA, a C++ compiler). Measured on the 2-core AVX2 EPYC, SmolLM2-135M's 211 linear
shapes in a row, weights streamed from memory: 20 ms (avx2) vs 35 ms (oneDNN) at 1 row, 26 vs 55 ms at 8
rows, 175 vs 210 ms at 64 (BENCHMARKS.md). Both keep the math (same weights and dtype, fp32 accumulation),
and in both each output row does not depend on how many rows are computed with it (avx2: one FMA chain per
output, by construction); only the summation order differs from MKL's, so a packed model is a
*configuration* of the target: the chain and its AR reference must both use it (`decode.fast`, `decode.gemm`).

GPTQ int4 linears (GPTQModel's TorchFusedLinear, the W4 level) keep their kernel but lose its Python
wrapper: the forward becomes cast to bf16, act-order `index_select`, `_weight_int4pack_mm_for_cpu`,
cast back. Same kernel and same math (identical logits), measured 0.50x -> 0.42x of the target's
1-token forward at 1 thread: the wrapper re-checks its mode, gathers with advanced indexing and
copies on every call, 210 times per forward of a 30-layer model.

A drafter's LM head can also run on int8 weights (`quantize_lm_head`, a chain level's `lm_head: int8`):
one scale per output row, `_weight_int8pack_mm` on bf16 activations. On a small model the LM head is
the largest single weight (SmolLM2-135M: 49,152 x 576, 113 MB in fp32), and a memory-bound forward
pays for its bytes: measured on 2 cores, 2.4 ms instead of the oneDNN-packed fp32 head's 4.6 ms for 1 row,
3.8 vs 5.3 ms for 4 rows (7.6 vs 6.2 ms for 8: the kernel scales with rows). Never for the target: it would change
the output; for a drafting level it changes only the proposals, which the level above verifies.

Sibling linears, the ones that read the same activation (an attention block's q/k/v, an MLP's
gate/up), are then run as one product (`fuse_siblings`): one packed weight (one int4 weight) with
their rows stacked, each sibling taking its slice of the output. Which linears are siblings is found by
tracing one forward (consecutive calls on the very same input tensor), not from module names, so any
architecture gets it; the fusion is kept only if that forward's logits are bit-identical to the unfused
ones. Measured on a 2-core AVX2 EPYC (256-token context): SmolLM2-135M's 1-token forward 48.5 -> 46.5 ms,
8 tokens 70.0 -> 66.2 ms; 210 linear calls per forward become 120 (the W4 copy's int4 ones too).

Attention never repeats K/V heads: HF's sdpa attention copies every layer's whole K and V cache to the
query head count whenever a mask is given (every forward of 2 or more new tokens, i.e. every
verification). With the AVX2 kernels, fp32 attention runs on `attend` (decode/kernels.cpp), which reads
grouped heads in place and computes each query row by one fixed sequence (softmax sums and the weighted
sum in key order, skipping masked keys), so a packed model's k-token forward gives the bits of its k
one-token forwards: verification logits equal plain decoding's exactly. Otherwise torch's CPU SDPA takes
the grouped heads with a mask directly (`enable_gqa`; measured on the 2-core AVX2 EPYC after the fusion
above, SmolLM2-135M's 2-token forward 51.8 -> 48.7 ms, 8 tokens 66.2 -> 62.3).

The original parameters stay in place (state_dict, weights hashes and training see the same model);
the packed copy is an inference-time cache. `unpack` restores plain `nn.Linear` forwards.
"""
from __future__ import annotations

import functools
import hashlib
import sys
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from data.models import cache_dir

GEMMS = ("auto", "avx2", "onednn")


def packing_available() -> bool:
    """oneDNN linear with prepacked weights exists in this torch build (CPU builds with MKL-DNN)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def packable_dtypes() -> tuple[torch.dtype, ...]:
    """Weight dtypes oneDNN can pack on this CPU: bf16 needs AVX512-BF16/AVX-NE-CONVERT-class support (an
    AVX2-only EPYC refuses it at packing time), so there bf16 linears keep their plain forward."""
    bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return (torch.float32, torch.bfloat16) if bf16 is not None and bf16() else (torch.float32,)


@functools.cache
def avx2_kernel() -> tuple[Any | None, str]:
    """(the decode/kernels.cpp extension built for this machine, "") or (None, why it cannot run here)."""
    return build_kernels(Path(__file__).with_name("kernels.cpp"), "the AVX2 kernels", "packed models use oneDNN and torch's attention")


def build_kernels(source: Path, what: str, fallback: str, flags: tuple[str, ...] = (),
                  includes: tuple[Path, ...] = ()) -> tuple[Any | None, str]:
    """(a C++ extension built from `source` for this machine, "") or (None, why it cannot run here), said once on
    stderr as `what` did not build; `fallback` says what runs instead. `includes`: the files it #includes (their
    folders are searched). Built once: it lives under the project's cache dir, keyed by the sources, the flags and
    the torch version."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None, f"the CPU lacks AVX2+FMA ({torch.backends.cpu.get_cpu_capability()})"
    from torch.utils import cpp_extension

    flags = ["-O3", "-mavx2", "-mfma", "-fopenmp", *flags, *sorted({f"-I{p.parent}" for p in includes})]
    texts = b"".join(p.read_bytes() for p in (source, *includes))
    key = hashlib.sha256(texts + " ".join(flags + [torch.__version__]).encode()).hexdigest()[:12]
    build = cache_dir() / "kernels" / key
    build.mkdir(parents=True, exist_ok=True)
    lock = build / "lock"  # left behind by a build that was killed: torch would wait for it forever
    if lock.exists() and time.time() - lock.stat().st_mtime > 300:
        lock.unlink(missing_ok=True)
    started = time.perf_counter()
    try:
        module = cpp_extension.load(f"polyspec_{source.stem}_{key}", [str(source)], extra_cflags=flags,
                                    extra_ldflags=["-fopenmp"], build_directory=str(build))
    except Exception as err:  # no compiler, no ninja, no Python headers: the fallback, said once
        why = (str(err).strip().splitlines() or [type(err).__name__])[-1]
        print(f"decode.fast: {what} did not build ({why[:200]}); {fallback}", file=sys.stderr)
        return None, why
    if time.perf_counter() - started > 5:
        print(f"decode.fast: built {what} in {time.perf_counter() - started:.0f} s (cached in {build})", file=sys.stderr)
    return module, ""


def gemm_for(dtype: torch.dtype, gemm: str = "auto") -> str | None:
    """Which packed product a weight of `dtype` gets: "avx2", "onednn", or None (the linear stays plain)."""
    if gemm not in GEMMS:
        raise ValueError(f"gemm must be one of {', '.join(GEMMS)}, got {gemm!r}")
    if dtype == torch.float32 and gemm != "onednn":
        kernel, why = avx2_kernel()
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
        return Panels(avx2_kernel()[0].pack(weight.contiguous()), weight.shape[0])
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def packed_with(model: nn.Module) -> str | None:
    """The packed product a model's dense linears run on ("avx2" or "onednn"), None if none is packed."""
    return next((m.gemm for m in model.modules() if isinstance(m, PackedLinear)), None)


def _packed_mm(x: torch.Tensor, packed: Panels | torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T + b through a packed W, for any leading shape of x."""
    flat = x.reshape(-1, x.shape[-1])
    if isinstance(packed, Panels):
        out = avx2_kernel()[0].linear(flat, packed.data, packed.rows, bias)
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
        self.sibling: tuple[SiblingGroup, int] | None = None  # set by fuse_siblings

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype or torch.is_grad_enabled() and x.requires_grad:
            return nn.functional.linear(x, self.weight, self.bias)
        if self.sibling is not None:
            out = self.sibling[0].output(self.sibling[1], x)
            return out if out is not None else nn.functional.linear(x, self.weight, self.bias)
        return _packed_mm(x, self.packed, None if self.bias is None else self.bias.detach())

    def __deepcopy__(self, memo: dict) -> "PackedLinear":
        """Parameters are copied as usual; the packed weight (oneDNN's is an opaque tensor that cannot be
        copied) is shared with the copy, which is correct while weights stay frozen, as at inference.
        A fused sibling's copy gets its own packed weight and runs unfused."""
        import copy

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


class Int8RowLinear(nn.Module):
    """Inference-only stand-in for a bias-free nn.Linear (an LM head): int8 weights, one scale per output
    row (symmetric, absmax / 127), run by aten's int8 weight-only kernel on bf16 activations, fp32 out.
    That kernel's vectorised CPU path (AVX2 is enough) takes bf16 activations; on fp32 ones it is a scalar
    loop, 3x slower than the packed fp32 weight. The original weight stays attached (state_dict unchanged)."""

    def __init__(self, linear: nn.Module):
        super().__init__()
        self.out_features, self.in_features = linear.weight.shape
        self.weight, self.bias = linear.weight, None
        w = linear.weight.detach().float()
        scales = w.abs().amax(dim=1).clamp_min(1e-12) / 127
        self.qweight = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        self.scales = scales.to(torch.bfloat16)

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


def _children(model: nn.Module):
    for parent in model.modules():
        for name, child in list(parent.named_children()):
            yield parent, name, child


def _int4_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """TorchFusedLinear's CPU inference path without its wrapper (bound to the module by `pack`)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return type(self).forward(self, x)
    sibling = getattr(self, "sibling", None)
    out = sibling[0].output(sibling[1], x) if sibling is not None else None
    if out is not None:
        return out
    return _int4_mm(x, self.gather_index, self.qweight, self.group_size, self.scales_and_zeros, self.bias)


def _int4_mm(x: torch.Tensor, gather_index: torch.Tensor, qweight: torch.Tensor, group_size: int,
             scales_and_zeros: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).index_select(1, gather_index)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, qweight, group_size, scales_and_zeros)
    if bias is not None:
        out.add_(bias)
    return out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])


def _is_cpu_int4(module: nn.Module) -> bool:
    """A GPTQModel TorchFusedLinear on the CPU, in eval mode, not yet used for training."""
    mode = getattr(module, "linear_mode", "absent")
    return (type(module).__name__ == "TorchFusedLinear" and hasattr(module, "transform") and not module.training
            and (mode is None or getattr(mode, "name", "") == "INFERENCE") and module.qweight.device.type == "cpu"
            and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"))


def _pack_int4(module: nn.Module) -> None:
    """Repack once as the module's own first inference forward would (int4pack layout, act-order index),
    then bind the lean forward to the instance; its tensors and state_dict keys stay where they were."""
    if module.linear_mode is None:
        from gptqmodel.looper.linear_mode import LinearMode

        module.transform(torch.bfloat16, "cpu")
        module.linear_mode = LinearMode.INFERENCE
    module.gather_index = module.ret_idx.long()
    module.forward = _int4_forward.__get__(module)


def pack(model: nn.Module, gemm: str = "auto") -> int:
    """Swap every CPU nn.Linear of a float32 (bfloat16 where oneDNN packs it) model for a PackedLinear on the
    `gemm` product (see `gemm_for`) and give every CPU GPTQ int4 linear the lean forward, in place; returns how
    many layers changed. Dense layers no packed product can run stay plain."""
    count = 0
    for parent, name, child in _children(model):
        if _is_cpu_int4(child):
            _pack_int4(child)
            count += 1
        elif (type(child) is nn.Linear and child.weight.device.type == "cpu"
              and gemm_for(child.weight.dtype, gemm) is not None):
            setattr(parent, name, PackedLinear(child, gemm))
            count += 1
    if count and isinstance(model, PreTrainedModel):
        fuse_siblings(model)
        if model.config._attn_implementation == "sdpa":
            model.set_attn_implementation(KERNEL_ATTENTION if packed_with(model) == "avx2" else GROUPED_SDPA)
    return count


GROUPED_SDPA = "polyspec_grouped_sdpa"
KERNEL_ATTENTION = "polyspec_attend"


def grouped_sdpa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """HF's sdpa attention without `repeat_kv` when a mask is given on the CPU (see the module docstring);
    every other case (no mask, one K/V head per query head, position bias, paged caches) is HF's own."""
    if (attention_mask is None or getattr(module, "num_key_value_groups", 1) == 1 or query.device.type != "cpu"
            or _special(kwargs)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                                     scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def kernel_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """fp32 attention on the AVX2 `attend` kernel (row-exact, grouped heads read in place, see the module
    docstring); anything it does not cover (other dtypes, dropout, position bias, softcapping, attention
    sinks) goes to `grouped_sdpa_attention`."""
    kernels = avx2_kernel()[0]
    if (kernels is None or query.device.type != "cpu" or dropout or _special(kwargs)
            or not query.dtype == key.dtype == value.dtype == torch.float32 or query.shape[-1] % 8 or query.shape[-1] > 256
            or attention_mask is not None and attention_mask.dtype not in (torch.bool, torch.float32)):
        return grouped_sdpa_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    causal = attention_mask is None and query.shape[2] > 1 and (is_causal if is_causal is not None else getattr(module, "is_causal", True))
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return kernels.attend(query, key, value, attention_mask, scale, causal), None


def _special(kwargs: dict) -> bool:
    """Attention features only HF's own sdpa path implements."""
    return (any(kwargs.get(k) is not None for k in ("position_bias", "cache", "softcap", "s_aux", "sinks"))
            or bool(kwargs.get("output_attentions")))


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)
AttentionInterface.register(KERNEL_ATTENTION, kernel_attention)
AttentionMaskInterface.register(KERNEL_ATTENTION, sdpa_mask)


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


def _is_lean_int4(module: nn.Module) -> bool:
    return getattr(vars(module).get("forward"), "__func__", None) is _int4_forward


def _siblings(model: nn.Module, ids: torch.Tensor) -> tuple[list[list[nn.Module]], torch.Tensor]:
    """Runs of consecutive packed (or lean int4) linear calls on the same input tensor, in one traced
    forward; and that forward's logits."""
    calls: list[tuple[nn.Module, torch.Tensor]] = []
    linears = [m for m in model.modules() if isinstance(m, PackedLinear) or _is_lean_int4(m)]
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


def _fused_run(members: list[nn.Module]) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The stacked product of `members`, or None if they cannot share one (int4 with different act-order
    or group size)."""
    first = members[0]
    if isinstance(first, PackedLinear):
        weight = torch.cat([m.weight.detach() for m in members])
        bias = None if all(m.bias is None for m in members) else torch.cat(
            [m.bias.detach() if m.bias is not None else weight.new_zeros(m.out_features) for m in members])
        packed = pack_weight(weight, first.gemm)
        return lambda x: _packed_mm(x, packed, bias)
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


def unpack(model: nn.Module) -> int:
    """Undo `pack`: plain nn.Linear forwards and HF's sdpa attention again (e.g. before training or moving
    to another device)."""
    count = 0
    if isinstance(model, PreTrainedModel) and model.config._attn_implementation in (GROUPED_SDPA, KERNEL_ATTENTION):
        model.set_attn_implementation("sdpa")
    for parent, name, child in _children(model):
        if isinstance(child, PackedLinear):
            setattr(parent, name, child.to_linear())
            count += 1
        elif _is_lean_int4(child):
            del child.forward  # back to the class's own forward (the int4pack layout stays: it is the kernel's)
            child.sibling = None
            count += 1
    return count
