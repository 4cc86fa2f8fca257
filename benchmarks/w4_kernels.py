"""`python -m benchmarks.w4_kernels`: which CPU kernel runs the W4 checkpoint fastest, next to the target.

Times one forward of `quantize.eval.timing_tokens` new tokens (1 and 8) over a KV cache of
`quantize.eval.timing_context` tokens for the full-precision target (fp32, bf16) and for the W4 model
under each GPTQModel CPU kernel and under plain `transformers` loading (its own kernel choice), all in
one process, interleaved per repeat, medians. The winner is what `data.models.load_model` uses for GPTQ
folders (GPTQ_CPU_BACKEND).
Writes `${run_dir}/w4_kernels.json`.
"""
from __future__ import annotations

import hydra
import torch
from omegaconf import DictConfig
from transformers import AutoModelForCausalLM, GPTQConfig, PreTrainedModel

from data.models import load_model, load_tokenizer, resolve_model_path
from data.sharegpt import load_split, tokenize_conversation
from infra.cli import run_main
from infra.tracking import write_json_atomic
from quantize.errors import QuantizeError
from quantize.evaluation import forward_ms
from quantize.settings import KernelsSettings, kernels_of

# (label, backend or None for transformers' own choice, dtype of the non-quantized parts)
W4_VARIANTS = [
    ("W4 TorchFusedLinear, fp32 rest", "torch_fused", torch.float32),
    ("W4 TorchFusedLinear, bf16 rest", "torch_fused", torch.bfloat16),
    ("W4 TorchAtenLinear, bf16 rest", "gptq_torch_aten", torch.bfloat16),
    ("W4 TorchInt8Linear, fp32 rest", "torch_int8", torch.float32),
    ("W4 plain transformers (auto kernel)", None, None),
]


def load_w4(path: str, backend: str | None, dtype: torch.dtype | None) -> PreTrainedModel:
    kwargs = {"quantization_config": GPTQConfig(bits=4, backend=backend)} if backend else {}
    if dtype is not None:
        kwargs["dtype"] = dtype
    return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def kernel_kind(model: PreTrainedModel) -> str:
    kinds = {type(m).__name__ for m in model.modules() if type(m).__module__.startswith("gptqmodel.nn_modules.qlinear")}
    return ", ".join(sorted(kinds)) or "none"


def run(settings: KernelsSettings) -> dict[str, dict[str, float | str]]:
    layout, timing = settings.layout, settings.timing
    w4_path = layout.output("w4")
    if not (w4_path / "config.json").exists():
        raise QuantizeError(f"{w4_path}: no W4 checkpoint; run python -m quantize.w4 first")
    _, held_out = load_split(settings.data)  # the data before any model: a bad source is refused in seconds
    src = resolve_model_path(settings.model.name)
    tokenizer = load_tokenizer(src)
    context: list[int] = []
    for conv in held_out:
        context += tokenize_conversation(tokenizer, conv, timing.timing_context).input_ids
        if len(context) >= timing.timing_context:
            break
    context = context[: timing.timing_context]

    models: dict[str, PreTrainedModel] = {
        "target fp32": load_model(src, dtype="float32")[0],
        "target bf16": load_model(src, dtype="bfloat16")[0],
    }
    kinds = {name: "dense" for name in models}
    for label, backend, dtype in W4_VARIANTS:
        try:
            models[label] = load_w4(str(w4_path), backend, dtype)
            kinds[label] = kernel_kind(models[label])
        except Exception as err:  # a kernel that does not load here is a result, not a failure
            print(f"{label}: not available ({err.__class__.__name__}: {(str(err).splitlines() or [''])[0][:120]})")
    runnable = {}
    for name, model in models.items():
        try:
            with torch.no_grad():
                model(torch.tensor([context[:16]]))
            runnable[name] = model
        except Exception as err:
            print(f"{name}: forward fails ({err.__class__.__name__}: {(str(err).splitlines() or [''])[0][:120]})")
    ks = list(timing.timing_tokens)
    ms = forward_ms(runnable, context, ks, timing.timing_repeats)
    base = ms["target fp32"]
    print(f"\nmedian ms per forward, {len(context)}-token KV cache, {timing.timing_repeats} repeats, interleaved")
    versus = "vs fp32 (" + "/".join(map(str, ks)) + ")"
    print(f"{'model':40s}" + "".join(f"{f'{k} tok':>9s}" for k in ks) + f"{versus:>16s}  kernel")
    for name, per in ms.items():
        ratios = "".join(f"{per[k] / base[k]:{8 if i == 0 else 7}.2f}x" for i, k in enumerate(ks))
        print(f"{name:40s}" + "".join(f"{per[k]:9.1f}" for k in ks) + f"{ratios}  {kinds[name]}")
    result = {name: {**{f"ms_{k}tok": per[k] for k in ks}, "kernel": kinds[name]} for name, per in ms.items()}
    write_json_atomic(layout.kernels_report, result)
    return result


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_main(lambda: run(kernels_of(cfg)))


if __name__ == "__main__":
    main()
