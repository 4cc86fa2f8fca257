"""The compiled static runner on a CPU (decode.backend=static: transformers' forward compiled, its linears and
attention on the project's kernels as torch operators) against the native runner (the hand-written C++ decoder), for
the default target and, given its folder, a W4 copy (int8 activations): each model loaded twice, the same packed
weights, timed side by side in one process: a level's forward of k new tokens after a real context (LM head
included), medians of interleaved repeats, and the ratio. The compile of the widths asked is timed apart.

    python -m benchmarks.compiled_cpu [--w4 RUN_DIR/w4] [--widths 1 2 4 8 16] [--ks 1 4 8] [--repeats 30]
        [--backend inductor|aoti]"""
from __future__ import annotations

import argparse
import time

import torch

from data.models import DEFAULT_MODEL, load_model, load_tokenizer
from decode.backends import Backend
from decode.backends.static import CompiledRunner
from decode.engine.levels import LevelCompute, ModelLevel
from infra.timing import interleaved_ms, level_forward, medians


def pair(spec: str, native: Backend, widths: tuple[int, ...],
         backend: str) -> tuple[ModelLevel, ModelLevel, float]:
    """(a native level, a compiled one, seconds to compile its widths) of the model `spec`, loaded once for each;
    `backend` compiles it (inductor: torch.compile; aoti: AOTInductor, decode.backends.aoti)."""
    native_level = ModelLevel("native", native.prepare(load_model(spec)[0]))
    compiled = Backend("avx2", activations=native.activations, runner="static").prepare(
        load_model(spec)[0])
    started = time.perf_counter()
    runner = CompiledRunner(compiled.model, widths, backend=backend)
    return native_level, ModelLevel("compiled", compiled, compute=LevelCompute(runner)), time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--w4", help="a W4 folder quantize.w4 wrote (RUN_DIR/w4)")
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--backend", choices=("inductor", "aoti"), default="inductor")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    context = tokenizer(" ".join(["The quick brown fox jumps over the lazy dog."] * 64)).input_ids[: args.context]
    models = {"target": (DEFAULT_MODEL, Backend("avx2", native_fp32="on"))}
    if args.w4:
        models["w4 (int8 activations)"] = (args.w4, Backend("avx2", native_w4="on"))
    print(f"{args.threads} threads, context {len(context)}, {args.repeats} repeats, widths {args.widths}")
    for name, (spec, native) in models.items():
        native_level, compiled_level, compile_s = pair(spec, native, tuple(args.widths), args.backend)
        steps = {"native": level_forward(native_level, context), "compiled": level_forward(compiled_level, context)}
        times = medians(interleaved_ms(steps, args.ks, args.repeats))
        print(f"{name}: compiled every width in {compile_s:.0f} s")
        for k in args.ks:
            print(f"  k={k:2d}: native {times['native'][k]:6.2f} ms, compiled {times['compiled'][k]:6.2f} ms, "
                  f"compiled / native {times['compiled'][k] / times['native'][k]:.2f}x")


if __name__ == "__main__":
    main()
