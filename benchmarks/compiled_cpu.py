"""The compiled static runner on a CPU (decode.backend=static: transformers' forward compiled, its linears and
attention on the project's kernels as torch operators) against the native runner (the hand-written C++ decoder), for
the default target, given its folder a W4 copy (int8 activations), and with `--head` an untrained EAGLE-2 head of the
target (a 4,096-token draft vocabulary, as the default's; timing only): each loaded twice, the same packed weights,
timed side by side in one process: a level's forward of k new tokens after a real context (LM head included), medians
of interleaved repeats, and the ratio. The compile of the widths asked is timed apart.

    python -m benchmarks.compiled_cpu [--w4 RUN_DIR/w4] [--head] [--widths 1 2 4 8 16] [--ks 1 4 8] [--repeats 30]
        [--backend inductor|aoti]"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import time

import torch

from data.models import DEFAULT_MODEL, load_model, load_tokenizer
from decode.backends import Backend
from decode.backends.static import CompiledHeadRunner, CompiledRunner
from decode.costs import head_forward
from decode.engine.levels import LevelCompute, ModelLevel
from heads.eagle import EagleHead
from infra.timing import Step, interleaved_ms, level_forward, medians


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


def head_pair(context: list[int], widths: tuple[int, ...], backend: str) -> tuple[Step, Step, float]:
    """(the native head runner's step, the compiled one's, seconds to compile its widths) of an untrained EAGLE-2
    head of the default target, drafting from the target's last hidden states on `context`."""
    target = load_model(DEFAULT_MODEL)[0]
    with torch.no_grad():
        features = target(torch.tensor([context]), output_hidden_states=True).hidden_states[-1]
    torch.manual_seed(0)
    head = EagleHead.for_target(target, draft_vocab=torch.arange(4096)).eval()
    native = Backend("avx2", native_fp32="on").prepare_head(head)
    compiled = Backend("avx2", runner="static").prepare_head(copy.deepcopy(head))
    started = time.perf_counter()
    runner = CompiledHeadRunner(compiled.head, widths, backend=backend)
    compile_s = time.perf_counter() - started
    compiled = dataclasses.replace(compiled, new_runner=lambda: runner)
    return head_forward(native, context, features), head_forward(compiled, context, features), compile_s


def report(name: str, steps: dict[str, Step], compile_s: float, ks: list[int], repeats: int) -> None:
    times = medians(interleaved_ms(steps, ks, repeats))
    print(f"{name}: compiled every width in {compile_s:.0f} s")
    for k in ks:
        print(f"  k={k:2d}: native {times['native'][k]:6.2f} ms, compiled {times['compiled'][k]:6.2f} ms, "
              f"compiled / native {times['compiled'][k] / times['native'][k]:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--w4", help="a W4 folder quantize.w4 wrote (RUN_DIR/w4)")
    parser.add_argument("--head", action="store_true", help="also an untrained EAGLE-2 head of the target")
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
        report(name, steps, compile_s, args.ks, args.repeats)
    if args.head:
        native_step, compiled_step, compile_s = head_pair(context, tuple(args.widths), args.backend)
        report("head (EAGLE-2, V=4096)", {"native": native_step, "compiled": compiled_step}, compile_s, args.ks,
               args.repeats)

if __name__ == "__main__":
    main()
