"""The static graph runner (decode.backends.cuda) measured and checked on one device, in one short run.

    python scripts/gpu_runner_check.py --model HF_FOLDER --out DIR [--device cuda|cpu] [--dtype bf16|fp32]
                                       [--max-new 128] [--repeats 50]

Prints and writes DIR/gpu_runner_check.json:
- ms: median decoder forward (runner.forward, the LM head not included) after a 64-token context, synchronized clock:
  HFRunner (eager, DynamicCache) T(1), the static runner eager T(1), its CUDA graphs T(k) for k in 1, 2, 4, 8, 16;
- floors: the device's read bandwidth (median of a large tensor sum), the decoder weights' streaming floor (bytes /
  bandwidth), and the launch floor: the kernels of one static eager forward, counted with torch.profiler, replayed as a
  CUDA graph of as many 1-element adds (CUDA only);
- greedy: --max-new tokens from 3 prompts through the engine's autoregressive decoding on the static runner vs on
  HFRunner (same dtype; identical, or the first divergence with the target's top-2 logit margin there), and a target <-
  prompt-lookup chain on the static runner vs that AR; tokens/s of each and the chain's speedup.
Needs only torch, transformers and this project's source (asserted at the end: no hydra, omegaconf, wandb, deepspeed,
gptqmodel loaded)."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this project's source, wherever the script runs from

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from decode.backends.cuda import StaticRunner  # noqa: E402
from decode.chains.baselines import autoregressive  # noqa: E402
from decode.engine.chain import Chain  # noqa: E402
from decode.engine.levels import LevelCompute, ModelLevel, NgramLevel  # noqa: E402
from decode.engine.runner import HFRunner  # noqa: E402
from infra.device import synchronized_clock  # noqa: E402
from infra.timing import launches, read_bandwidth, weight_bytes  # noqa: E402

FORBIDDEN = ("hydra", "omegaconf", "wandb", "deepspeed", "gptqmodel")
CONTEXT, WIDTHS = 64, (1, 2, 4, 8, 16)
TEXTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "def factorial(n):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. Once more: the",
    "Question: list the planets of the solar system in order from the sun, one per line.\nAnswer:\n1. Mercury\n",
]


def load(folder: str, device: torch.device, dtype: torch.dtype):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError):
        tokenizer = None  # a bare model folder (the CPU smoke test): seeded random prompts with repeats
    return model, tokenizer


def prompts(tokenizer, vocab: int) -> list[list[int]]:
    if tokenizer is not None:
        return [tokenizer(text)["input_ids"] for text in TEXTS]
    gen = torch.Generator().manual_seed(0)
    bodies = [torch.randint(0, vocab, (8 + 6 * i,), generator=gen).tolist() for i in range(3)]
    return [body + body[:4] + body for body in bodies]


def forward_ms(runner, width: int, repeats: int, warmup: int = 5) -> float:
    """Median ms of one forward of `width` tokens after a CONTEXT-token context (cropped back to it each time)."""
    vocab, device = runner.config.vocab_size, runner.device
    context = torch.randint(0, vocab, (1, CONTEXT), generator=torch.Generator().manual_seed(1)).to(device)
    ids = context[:, :width]
    with torch.inference_mode():
        runner.reset()
        runner.forward(context, None, None)
        times = []
        for i in range(warmup + repeats):
            runner.crop(CONTEXT)
            start = synchronized_clock(device)
            runner.forward(ids, None, None)
            if i >= warmup:
                times.append((synchronized_clock(device) - start) * 1000)
    return statistics.median(times)


def bandwidth(device: torch.device, repeats: int = 11) -> float:
    """Bytes per second of a large tensor sum on `device` (median)."""
    if device.type != "cuda":
        return read_bandwidth(0.25).bytes_per_s
    data = torch.ones(2**30 // 4, device=device)  # 1 GiB, far beyond L2
    times = []
    for _ in range(repeats + 1):
        start = synchronized_clock(device)
        data.sum()
        times.append(synchronized_clock(device) - start)
    return data.numel() * 4 / statistics.median(times[1:])


def kernel_count(runner) -> int:
    """CUDA kernels (and copies) of one eager static forward of one token after CONTEXT (infra.timing.launches)."""
    with torch.inference_mode():
        runner.reset()
        runner.forward(torch.zeros(1, CONTEXT, dtype=torch.long, device=runner.device), None, None)
    ids = torch.zeros(1, 1, dtype=torch.long, device=runner.device)

    def step(k: int) -> object:
        runner.crop(CONTEXT)
        with torch.inference_mode():
            return runner.forward(ids, None, None)

    return launches(step, runner.device)["kernels"]


def launch_floor_ms(device: torch.device, kernels: int, repeats: int) -> float:
    """Median ms of a replayed CUDA graph of `kernels` 1-element adds: launch and dependency cost, no work."""
    x = torch.zeros(1, device=device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        x.add_(1)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(kernels):
            x.add_(1)
    times = []
    for i in range(5 + repeats):
        start = synchronized_clock(device)
        graph.replay()
        if i >= 5:
            times.append((synchronized_clock(device) - start) * 1000)
    return statistics.median(times)


def timings(model, repeats: int) -> tuple[dict, dict]:
    """(ms, floors): the forwards' medians and the floors they are read against."""
    device = model.device
    ms = {"hf_eager_1": forward_ms(HFRunner(model), 1, repeats),
          "static_eager_1": forward_ms(StaticRunner(model, graphs=False), 1, repeats)}
    graphs = StaticRunner(model, widths=WIDTHS)
    for k in WIDTHS:
        ms[f"graph_{k}"] = forward_ms(graphs, k, repeats)
    head = model.get_output_embeddings().weight
    decoder_bytes = weight_bytes(model) - head.numel() * head.element_size()
    bw = bandwidth(device)
    floors = {"read_bandwidth_gb_s": bw / 1e9, "decoder_weight_bytes": decoder_bytes,
              "weight_streaming_floor_ms": decoder_bytes / bw * 1000}
    if device.type == "cuda":
        try:  # the profiler needs CUPTI: without it, say so and keep the rest of the run
            kernels = kernel_count(StaticRunner(model, graphs=False))
            floors.update(kernels_per_forward=kernels, launch_floor_ms=launch_floor_ms(device, kernels, repeats),
                          launch_floor_method="torch.profiler count of one eager static T(1) forward's CUDA kernels "
                                              "and copies, replayed as a CUDA graph of as many 1-element adds")
        except RuntimeError as err:
            floors["launch_floor_error"] = str(err).splitlines()[0] if str(err) else type(err).__name__
    return ms, floors


def divergence(model, prompt: list[int], ref: list[int], got: list[int]) -> dict:
    """Where `got` leaves `ref` (None: identical), and the target's top-2 logit margin there (a full forward)."""
    at = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
    if at is None:
        return {"identical": len(ref) == len(got), "first_divergence": None}
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + ref[:at]], device=model.device)).logits[0, -1].float()
    top = logits.topk(2).values
    margin = float(top[0] - top[1])
    return {"identical": False, "first_divergence": at, "margin": margin,
            "relative_margin": margin / max(1.0, abs(float(top[0])))}


def decode_all(decode, ids: list[list[int]], max_new: int) -> tuple[list[list[int]], float]:
    """Every prompt's new tokens and tokens/s over all, after an untimed decode of each (the graphs it needs are
    captured at their first use)."""
    for prompt in ids:
        decode(prompt, max_new)
    runs = [decode(prompt, max_new) for prompt in ids]
    return [run.tokens for run in runs], sum(len(r.tokens) for r in runs) / sum(r.stats.wall_time_s for r in runs)


def greedy(model, ids: list[list[int]], max_new: int) -> dict:
    """AR on HFRunner, AR on the static runner, target <- prompt lookup on the static runner: identity and speed."""
    hf, hf_speed = decode_all(lambda p, n: autoregressive(model, p, n), ids, max_new)
    static = StaticRunner(model)  # one runner reused: its graphs are captured once for every decode through it
    ar, ar_speed = decode_all(lambda p, n: autoregressive(model, p, n, runner=static), ids, max_new)
    chain = Chain([ModelLevel("target", model, compute=LevelCompute(static)),
                   NgramLevel("lookup", max_ngram=3, draft={"mode": "chain", "length": 6})])
    lookup, lookup_speed = decode_all(chain.generate, ids, max_new)
    ar_vs_hf = [divergence(model, p, a, b) for p, a, b in zip(ids, hf, ar)]
    chain_vs_ar = [divergence(model, p, a, b) for p, a, b in zip(ids, ar, lookup)]
    return {"ar_static_vs_ar_hf": ar_vs_hf, "chain_vs_ar_static": chain_vs_ar,
            "ar_identical": all(d["identical"] for d in ar_vs_hf),
            "chain_identical": all(d["identical"] for d in chain_vs_ar),
            "tokens_per_s": {"ar_hf": hf_speed, "ar_static": ar_speed, "lookup_chain_static": lookup_speed},
            "speedup_chain_vs_ar_static": lookup_speed / ar_speed, "speedup_chain_vs_ar_hf": lookup_speed / hf_speed,
            "speedup_ar_static_vs_ar_hf": ar_speed / hf_speed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a transformers causal LM folder (or hub name)")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on CUDA, else fp32")
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    model, tokenizer = load(args.model, device, dtype)
    ids = prompts(tokenizer, model.config.vocab_size)
    ms, floors = timings(model, args.repeats)
    report = {"model": args.model, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "dtype": str(dtype), "torch": torch.__version__, "transformers": sys.modules["transformers"].__version__,
              "context": CONTEXT, "repeats": args.repeats, "ms": ms, "floors": floors,
              "greedy": greedy(model, ids, args.max_new), "max_new": args.max_new}
    report["forbidden_modules_loaded"] = [name for name in FORBIDDEN if name in sys.modules]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_runner_check.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    assert not report["forbidden_modules_loaded"], f"loaded {report['forbidden_modules_loaded']}"
    return 0


if __name__ == "__main__":
    sys.exit(main())
