"""The compiled static runner on a CPU (decode.backend=static: transformers' forward compiled, its linears and
attention on the project's kernels as torch operators) against the native runner (the hand-written C++ decoder), the
same packed weights, side by side in one process: each one's forward of k new tokens after a real context, medians of
interleaved repeats, and the ratio. Compiling every width is part of making the runner (its time is printed).

    python -m benchmarks.compiled_cpu [--context 256] [--ks 1 2 4 8] [--repeats 30] [--threads 2]"""
from __future__ import annotations

import argparse
import time

import torch

from data.models import DEFAULT_MODEL, load_model
from decode.backends import Backend
from decode.engine.levels import ModelLevel
from infra.timing import interleaved_ms, level_forward, medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(DEFAULT_MODEL, "float32", "cpu")
    native = Backend("avx2", native_fp32="on").prepare(model)
    started = time.perf_counter()
    compiled = Backend("avx2", runner="static").prepare(model)
    level = ModelLevel("compiled", compiled)
    compile_s = time.perf_counter() - started
    context = tokenizer(" ".join(["The quick brown fox jumps over the lazy dog."] * 64)).input_ids[: args.context]
    steps = {"native": level_forward(ModelLevel("native", native), context),
             "compiled": level_forward(level, context)}
    times = medians(interleaved_ms(steps, args.ks, args.repeats))
    print(f"{DEFAULT_MODEL} fp32, {args.threads} threads, context {len(context)}, {args.repeats} repeats; "
          f"compiled runner made (every width compiled) in {compile_s:.0f} s")
    for k in args.ks:
        print(f"k={k:2d}: native {times['native'][k]:6.2f} ms, compiled {times['compiled'][k]:6.2f} ms, "
              f"compiled / native {times['compiled'][k] / times['native'][k]:.2f}x")


if __name__ == "__main__":
    main()
