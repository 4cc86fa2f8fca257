"""Other families' one-token forwards against the default's on the native runner: random-weight models of
SmolLM2-135M's shapes (30 layers, hidden 576, MLP 1536, 9 query and 3 K/V heads, 49,152 tokens) built as Qwen3,
Gemma 2 (softcapping, a window), Phi-3 (fused projections), Mistral (a window) and Qwen3-MoE (8 experts, 2 a
token, each half the dense MLP), each run as `decode.backend=auto` runs it today on a CPU and on the compiled
static runner (its kernels inside, a width compiled for each k), timed side by side with the default on the native
runner in one process (a level's forward of k tokens after a 256-token context, LM head included, medians of
interleaved repeats). Each row's ms per byte streamed (routed experts only) is given as a ratio to the default's.

    python -m benchmarks.families [--families qwen3 gemma2 phi3 mistral qwen3_moe] [--ks 1 4] [--repeats 20]
        [--backend inductor|aoti]"""
from __future__ import annotations

import argparse
import copy
import gc

import torch
import transformers

from data.models import DEFAULT_MODEL, load_model, load_tokenizer
from decode.backends import Backend
from decode.backends.cuda.runner import unsupported
from decode.backends.static import CompiledRunner
from decode.engine.levels import LevelCompute, ModelLevel
from infra.timing import interleaved_ms, level_forward, medians

SHAPES = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
              num_key_value_heads=3, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True)
WINDOW = 128  # under the context: the windowed families attend over a window
FAMILIES = {  # family: (config class, model class, settings over SHAPES)
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        query_pre_attn_scalar=64, final_logit_softcapping=30.0, attn_logit_softcapping=50.0, sliding_window=WINDOW,
        hidden_activation="gelu_pytorch_tanh")),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=768, norm_topk_prob=True)),
}


def family_model(family: str) -> torch.nn.Module:
    """A seeded random-weight model of `family` at SmolLM2-135M's shapes, fp32, in eval mode."""
    config_class, model_class, settings = FAMILIES[family]
    config = getattr(transformers, config_class)(**SHAPES, **settings)
    torch.manual_seed(0)
    return getattr(transformers, model_class)(config).eval()


def routed_bytes(model: torch.nn.Module) -> float:
    """The bytes a one-token forward streams through its weights: every parameter, an expert's only at its share of
    the routing (experts a token is routed to over all experts)."""
    config = model.config
    share = getattr(config, "num_experts_per_tok", 1) / max(getattr(config, "num_experts", 1), 1)
    experts = sum(p.nbytes for name, p in model.named_parameters() if ".experts." in name)
    return sum(p.nbytes for p in model.parameters()) - experts * (1 - share)


def levels(family: str, widths: tuple[int, ...], backend: str) -> dict[str, ModelLevel]:
    """The family's model as `auto` runs it today and, unless it refuses the model, on the compiled runner, `widths`
    compiled by `backend` (inductor: torch.compile; aoti: AOTInductor), two copies: preparing packs in place."""
    model = family_model(family)
    today = Backend("avx2").prepare(copy.deepcopy(model))
    rows = {f"{family}, {type(today.new_runner()).__name__}": ModelLevel("today", today)}
    why = unsupported(model)
    if why is not None:
        print(f"  {family}: the compiled runner refuses it ({why})")
        return rows
    compiled = Backend("avx2", runner="static").prepare(model)
    runner = CompiledRunner(compiled.model, widths, backend=backend)
    return rows | {f"{family}, {backend}": ModelLevel("compiled", compiled, compute=LevelCompute(runner))}


def report(times: dict[str, dict[int, float]], sizes: dict[str, float], base: str) -> None:
    for name, per in times.items():
        cells = "  ".join(f"k={k}: {ms:6.2f} ms ({ms / times[base][k]:.2f}x)" for k, ms in per.items())
        per_byte = (per[min(per)] / sizes[name]) / (times[base][min(per)] / sizes[base])
        print(f"  {name:28s} {cells}  T(1)/bytes {per_byte:.2f}x the default's")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--backend", choices=("inductor", "aoti"), default="inductor")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    context = load_tokenizer(DEFAULT_MODEL)(" ".join(["The quick brown fox jumps over the lazy dog."] * 64)).input_ids
    context = context[:256]
    base = "llama (the default), native"
    default = Backend("avx2", native_fp32="on").prepare(load_model(DEFAULT_MODEL)[0])
    steps = {base: level_forward(ModelLevel("native", default), context)}
    sizes = {base: routed_bytes(default.model)}
    print(f"{args.threads} threads, context {len(context)}, {args.repeats} repeats; ratios to the default's row")
    for family in args.families:
        family_levels = levels(family, tuple(sorted(set(args.ks))), args.backend)
        sizes |= {name: routed_bytes(level.model) for name, level in family_levels.items()}
        family_steps = {name: level_forward(level, context) for name, level in family_levels.items()}
        report(medians(interleaved_ms({base: steps[base], **family_steps}, args.ks, args.repeats)), sizes, base)
        del family_levels, family_steps
        gc.collect()


if __name__ == "__main__":
    main()
