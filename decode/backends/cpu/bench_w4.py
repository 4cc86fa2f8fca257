"""Micro-benchmark of the W4 level's forward: the native runner against the eager path (decode.backends.cpu.pack)
and the packed fp32 target, one forward of k new tokens on a cached context, interleaved in one process.

    python -m decode.backends.cpu.bench_w4 --w4 runs/default/w4 [--context 256] [--ks 1 8] [--repeats 21]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from data.models import DEFAULT_MODEL, load_model
from infra.timing import Step, cached_forward, median_ms, times_table
from decode.backends.cpu.llama import NativeInt8Linear, NativeLlamaRunner
from decode.backends.cpu import pack
from decode.backends.cpu.int8 import quantize_lm_head


def runner_forward(runner: NativeLlamaRunner, head: torch.nn.Module | None, context: list[int]) -> Step:
    """A step for `median_ms`: the runner's forward of k new tokens after `context` (then the LM head on all k)."""
    ids = torch.tensor([context])
    runner.reset()
    runner.forward(ids, None, None)

    def step(k: int) -> object:
        runner.crop(len(context) - k)
        with torch.inference_mode():
            hidden = runner.forward(ids[:, -k:], None, None)
            return head(hidden) if head is not None else hidden

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--w4", required=True, help="the W4 checkpoint folder (python -m quantize.w4)")
    parser.add_argument("--target", default=DEFAULT_MODEL)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    target, tokenizer = load_model(args.target, "float32")
    pack(target)
    w4, _ = load_model(args.w4)
    pack(w4)
    quantize_lm_head(w4)
    capacity = args.context + max(args.ks)
    exact, runner = NativeLlamaRunner(w4, capacity, "fp32"), NativeLlamaRunner(w4, capacity, "int8")
    int8_head = NativeInt8Linear(w4.get_output_embeddings())
    text = tokenizer(Path("README.md").read_text()).input_ids * 8
    context = text[: args.context + max(args.ks)]
    steps = {"target fp32 packed": cached_forward(target, context[: args.context]),
             "w4 eager (packed, int8 head)": cached_forward(w4, context[: args.context]),
             "w4 native fp32 act. (native int8 head)": runner_forward(exact, int8_head, context[: args.context]),
             "w4 native fp32 act., decoder only": runner_forward(exact, None, context[: args.context]),
             "w4 native int8 act. (aten int8 head)": runner_forward(runner, w4.get_output_embeddings(),
                                                                    context[: args.context]),
             "w4 native int8 act. (native int8 head)": runner_forward(runner, int8_head, context[: args.context]),
             "w4 native int8 act., decoder only": runner_forward(runner, None, context[: args.context])}
    times = median_ms(steps, args.ks, args.repeats)
    print(f"median ms of one forward, {args.context}-token context, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print("\n".join(times_table(times, "target fp32 packed", "target")))


if __name__ == "__main__":
    main()
