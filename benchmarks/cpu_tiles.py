"""Micro-benchmark of the native products' two limits, per product kind (fp32 panels: the target; int4 codes on int8
activations: W4, and on fp32 activations: `decode.w4_activations=fp32`; int8 rows on int8 activations: int8 LM heads and
heads), on k rows: the arithmetic (one thread, the weight resident in L2: what a core computes per weight byte) and the
stream (all threads, weights far beyond the caches, as a forward reads them). A forward made of one kind cannot beat
either; so with its 1-row product at the read bandwidth, its T(k) / T(1) is at least bandwidth / (threads x arithmetic
rate at k rows): the `bound` column.

    python -m benchmarks.cpu_tiles [--inputs 576] [--rows 1 2 4 8] [--repeats 7] [--stream-mib 256]
"""
from __future__ import annotations

import argparse
from typing import Any, Callable

import torch
from torch import nn

from decode.backends.cpu.llama import dense_weight, int4_weight, int8_weight, native_kernels, stream_kernel
from infra.timing import median_ms, read_bandwidth

RESIDENT_BYTES = 256 * 2**10  # a quarter of Zen 4's L2, a half of Zen 3's: resident with room for the inputs


def random_int4(kernels: Any, outputs: int, inputs: int, activations: str = "int8") -> Any:
    """Random GPTQ-style codes, one scale per output and group of 128 inputs, as the W4 level packs them for int8 or
    fp32 activations."""
    codes = torch.randint(0, 16, (outputs, inputs), dtype=torch.int32)
    return int4_weight(kernels, (codes, torch.rand(outputs, -(-inputs // 128)) + 0.1, None), 128, activations)


def kinds(kernels: Any) -> dict[str, tuple[Callable[[int, int], Any], float]]:
    """Each product kind: (a weight of `outputs` x `inputs` in it, its bytes per weight, scales aside)."""
    def linear(outputs: int, inputs: int) -> nn.Linear:
        return nn.Linear(inputs, outputs, bias=False)

    return {"fp32 panels": (lambda n, k: dense_weight(kernels, [linear(n, k)]), 4.0),
            "int4 codes, int8 act.": (lambda n, k: random_int4(kernels, n, k), 0.5),
            "int4 codes, fp32 act.": (lambda n, k: random_int4(kernels, n, k, "fp32"), 0.5),
            "int8 rows, int8 act.": (lambda n, k: int8_weight(kernels, [linear(n, k)]), 1.0)}


def seconds_per_call(kernels: Any, x: torch.Tensor, weights: list[Any], calls: int, repeats: int) -> float:
    """Median over `repeats` of the time of one product, going `calls` times through `weights` in turn."""
    def products(_: int) -> None:
        for i in range(calls):
            kernels.packed_mm(x, weights[i % len(weights)])

    return median_ms({"products": products}, [calls], repeats, warmup=0)["products"][calls] / 1000 / calls


def measure(kernels: Any, make: Callable[[int, int], Any], per_weight: float,
            args: argparse.Namespace) -> dict[int, tuple[float, float]]:
    """Per row count of `args.rows`: (resident bytes/s on one thread, streamed bytes/s on all threads), weights'
    bytes per second (`args`: main's inputs, rows, repeats and stream_mib)."""
    inputs, repeats = args.inputs, args.repeats
    threads = torch.get_num_threads()
    resident = make(max(48, int(RESIDENT_BYTES / (inputs * per_weight)) // 48 * 48), inputs)
    big = make(1536, inputs)
    streamed = [big] + [make(1536, inputs) for _ in range(max(1, args.stream_mib * 2**20 // big.nbytes) - 1)]
    out = {}
    for k in args.rows:
        x = torch.randn(k, inputs)
        torch.set_num_threads(1)
        alone = seconds_per_call(kernels, x, [resident], 200, repeats)
        torch.set_num_threads(threads)
        stream = seconds_per_call(kernels, x, streamed, len(streamed), repeats)
        out[k] = (resident.nbytes / alone, big.nbytes / stream)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=576, help="K, a multiple of 16 (the default: SmolLM2-135M's)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--stream-mib", type=int, default=256, help="weights streamed per pass (beyond the caches)")
    args = parser.parse_args(argv)
    kernels, why = native_kernels()
    if kernels is None:
        raise SystemExit(f"cpu_tiles: no native kernels here ({why})")
    bandwidth = read_bandwidth(stream=stream_kernel())
    threads = torch.get_num_threads()
    print(f"{threads} threads, {kernels.lanes()} lanes, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"read bandwidth {bandwidth.bytes_per_s / 1e9:.1f} GB/s ({bandwidth.method}); K = {args.inputs}")
    print(f"{'kind':<24} {'rows':>4} {'1 core, L2 GB/s':>15} {'streamed GB/s':>13} {'streamed t(k)/t(1)':>18} "
          f"{'bound T(k)/T(1)':>15}")  # bound: the k-row arithmetic floor over the 1-row byte floor
    for name, (make, per_weight) in kinds(kernels).items():
        rates = measure(kernels, make, per_weight, args)
        first = rates[args.rows[0]][1]
        for k, (alone, stream) in rates.items():
            bound = max(1.0, bandwidth.bytes_per_s / (threads * alone))
            print(f"{name:<24} {k:>4} {alone / 1e9:>15.1f} {stream / 1e9:>13.1f} {first / stream:>18.2f} "
                  f"{bound:>15.2f}")


if __name__ == "__main__":
    main()
