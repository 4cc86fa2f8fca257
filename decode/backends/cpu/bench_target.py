"""Micro-benchmark of the fp32 target's forward: the packed HF layers against the native runner, each as a chain's
target level runs it (runner and LM head), one forward of k new tokens on a cached context, interleaved in one
process; and beside them each one's floor: the bytes its one-token forward streams (counted from the buffers it
runs on) over the read bandwidth the STREAM-style probe measures here, in the same process, on the same threads.

    python -m decode.backends.cpu.bench_target [--context 256] [--ks 1 8] [--repeats 21] [--threads N]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from data.models import DEFAULT_MODEL, load_model
from decode.backends import Backend
from decode.backends.cpu.llama import stream_kernel
from decode.engine.levels import ModelLevel
from infra.timing import floors, level_forward, median_ms, read_bandwidth, times_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_MODEL)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    hf, tokenizer = load_model(args.target, "float32")
    hf = Backend("avx2").prepare(hf)
    native = Backend("avx2", native_fp32="on").prepare(load_model(args.target, "float32")[0])
    text = tokenizer(Path("README.md").read_text()).input_ids * 8
    context = text[: args.context]
    steps = {"target packed (HF layers)": level_forward(ModelLevel("target", hf), context),
             "target native": level_forward(ModelLevel("target", native), context)}
    times = median_ms(steps, args.ks, args.repeats)
    print(f"median ms of one forward (LM head included), {args.context}-token context, {torch.get_num_threads()} "
          f"threads, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print("\n".join(times_table(times, "target packed (HF layers)", "HF")))
    bandwidth = read_bandwidth(stream=stream_kernel())
    for name, row in floors(times, steps, bandwidth).items():
        print(f"{name}: floor {row['bytes'] / 2**20:.0f} MiB / {bandwidth.bytes_per_s / 1e9:.1f} GB/s "
              f"({bandwidth.method}) = {row['ms']:.1f} ms; T({args.ks[0]}) = {row['ratio']:.2f}x the floor")


if __name__ == "__main__":
    main()
