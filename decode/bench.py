"""`python -m decode.bench`: tokens/s and the ratio to plain autoregressive decoding, side by side.

Methods: AR (the target alone, KV cache), transformers assisted generation (the W4 model as the
assistant), transformers prompt lookup, the two-level chain, the three-level chain and any extra
chains (decode.bench.two_level / three_level / extra; a chain or assistant whose artifacts are
missing is replaced by its configured stand-in, and the table says so). All methods run in one
process, interleaved per prompt (the order rotates from prompt to prompt), and the table reports
medians, so machine noise hits every method alike (llama.cpp, where it runs, gets a phase of its own after
polyspec's methods in each round, decode.peers.llamacpp), and each method's pooled time speedup over AR with its
paired interval over prompts (decode.evaluation.speedup, level decode.bench.confidence). Each chain's per-level
numbers and its measured decoding time next to both predictions (Theorem 3.1 and the refined one) come
from decode.evaluation.measure, the same code decode.eval reports them with.
"""
from __future__ import annotations

import os
import statistics
import sys
from typing import Callable

import hydra
import torch
from omegaconf import DictConfig
from tqdm import tqdm

from decode.chains.build import builder_for, eos_of, level_model, load_target, onednn_target, reference_decoders
from decode.engine.errors import DecodeError
from decode.engine.levels import Generation
from decode.evaluation.measure import level_line, prediction_line, summarize
from decode.evaluation.speedup import Interval, time_speedup
from decode.settings import BenchSettings, bench_of
from infra.cli import check_writable, run_main
from infra.device import use_threads

Method = Callable[[list[int], int], Generation]


def methods(settings: BenchSettings, prepared, tokenizer) -> tuple[dict[str, Method], dict[str, str]]:
    """The decoders to compare, and a note per method on what it actually is (`prepared`: the configured target)."""
    from decode.backends import Backend
    from decode.backends.cpu.dense import packed_with
    from decode.chains.baselines import hf_assisted, hf_prompt_lookup
    from heads.eagle import HeadError
    from decode.engine.spec import LevelSpec, parse

    target, decoding, b = prepared.model, settings.decoding, settings.section
    eos, sampling = eos_of(target, tokenizer), decoding.sampling
    onednn = onednn_target(decoding, target)  # the other packed product, where the target runs on the AVX2 one
    found: dict[str, Method] = reference_decoders(decoding, prepared, eos, sampling,
                                                  {"ar_onednn": onednn} if onednn is not None else None)
    notes = {"ar": "target alone" + (f" (packed: {packed_with(target)})" if packed_with(target) else ""),
             "ar_eager": "target alone, plain eager nn.Linear",
             "ar_onednn": "target alone, packed with oneDNN (decode.gemm=onednn)"}
    notes = {name: note for name, note in notes.items() if name in found}
    builder = builder_for(decoding, prepared, tokenizer)
    if b.assistant is not None:
        assistant_level = b.assistant
        try:
            assistant = level_model(parse(LevelSpec, assistant_level, "decode.bench.assistant"), target, tokenizer,
                                    builder.artifacts, decoding.model.dtype)
        except DecodeError as err:
            print(f"hf_assisted: assistant unavailable ({err}); using stand-in {b.assistant_stand_in}",
                  file=sys.stderr)
            assistant_level = b.assistant_stand_in
            assistant = level_model(parse(LevelSpec, assistant_level, "decode.bench.assistant_stand_in"), target,
                                    tokenizer, builder.artifacts, decoding.model.dtype)
        Backend(builder.backend.gemm).prepare(assistant)  # packed as the target is
        found["hf_assisted"] = lambda p, n: hf_assisted(target, assistant, p, n, sampling, eos_token_id=eos)
        notes["hf_assisted"] = f"assistant {assistant_level}"
    found["hf_prompt_lookup"] = lambda p, n: hf_prompt_lookup(target, p, n, b.prompt_lookup_num_tokens, sampling,
                                                              eos_token_id=eos)
    notes["hf_prompt_lookup"] = f"{b.prompt_lookup_num_tokens} tokens"
    slots = {"two_level": b.two_level, "three_level": b.three_level, **{name: name for name in b.extra}}
    for slot, name in slots.items():
        if name is None:
            continue
        try:
            chain = builder.build(decoding.spec(name))
        except (DecodeError, HeadError) as err:
            stand_in = b.stand_ins.get(name)
            if not stand_in:
                raise
            print(f"{slot}: chain {name!r} unavailable ({err}); using stand-in {stand_in!r}", file=sys.stderr)
            name, chain = stand_in, builder.build(decoding.spec(stand_in))
        found[slot] = lambda p, n, chain=chain: chain.generate(p, n, sampling, eos_token_id=eos)
        notes[slot] = f"{name}: " + " <- ".join(f"{level.name}({level.kind})" for level in chain.levels)
    return found, notes


def summarise(runs: dict[str, list[Generation]], ar_tokens: list[list[int]], confidence: float) -> dict[str, dict]:
    ar_tps = [g.stats.tokens_per_s for g in runs["ar"]]
    ar_timed = [(g.stats.wall_time_s, g.stats.new_tokens) for g in runs["ar"]]
    summary = {}
    for name, gens in runs.items():
        tps = [g.stats.tokens_per_s for g in gens]
        ratios = [t / a for t, a in zip(tps, ar_tps) if a > 0]
        entry = {
            "median_tokens_per_s": statistics.median(tps),
            "median_ratio_vs_ar": statistics.median(ratios),
            "speedup_spec_bench": statistics.fmean(tps) / statistics.fmean(ar_tps),  # mean method tok/s / mean AR tok/s
            "median_ttft_s": statistics.median(g.stats.time_to_first_token_s for g in gens),
            "identical_to_ar": sum(g.tokens == ref for g, ref in zip(gens, ar_tokens)),
            "runs": len(gens),
            "time_speedup_interval": time_speedup(ar_timed, [(g.stats.wall_time_s, g.stats.new_tokens) for g in gens],
                                                  confidence).as_dict(),
        }
        if len(gens[0].stats.levels) > 1:
            entry["measured"] = summarize([g.stats for g in gens])  # per level and both predictions
        summary[name] = entry
    return summary


def table(summary: dict[str, dict], notes: dict[str, str]) -> str:
    rows = [f"{'method':<17} {'tok/s':>7} {'x AR':>6} {'x AR(sb)':>8} {'time x AR [interval]':>20} {'TTFT s':>7} "
            f"{'same':>6}  details"]
    for name, s in summary.items():
        detail = notes.get(name, "")
        if "measured" in s:
            detail += f" | {level_line(s['measured'])} | {prediction_line(s['measured'])}"
        rows.append(f"{name:<17} {s['median_tokens_per_s']:>7.2f} {s['median_ratio_vs_ar']:>6.2f} "
                    f"{s['speedup_spec_bench']:>8.2f} {_interval(name, s):>20} {s['median_ttft_s']:>7.2f} "
                    f"{s['identical_to_ar']:>3}/{s['runs']:<2}  {detail}")
    return "\n".join(rows)


def _interval(name: str, s: dict) -> str:
    """'1.01x [0.96, 1.06]' and a mark when shown faster (+) or slower (-) than AR; '-' for AR itself."""
    if name == "ar":
        return "-"
    x = Interval.from_dict(s["time_speedup_interval"])
    return x.text() + (" +" if x.above_one else " -" if x.below_one else "  ")


def run(settings: BenchSettings) -> dict:
    from data.prompts import load_questions
    from data.sharegpt import chat_prompt_ids
    from decode.peers import llamacpp
    from infra.tracking import write_json_atomic

    b, decoding, confidence = settings.section, settings.decoding, settings.confidence
    check_writable(b.out, "decode.bench.out", kind="file")  # refuse before minutes of decoding, not after
    use_threads(decoding.section.threads, "decode.threads")
    questions = load_questions(b.prompts, per_category=b.per_category)  # before any model: a bad file fails fast
    peer = llamacpp.bench_peer(decoding, b.llamacpp, torch.get_num_threads())  # None (said why) where it is off
    target, tokenizer = load_target(decoding)
    decoders, notes = methods(settings, target, tokenizer)
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": q.turns[0]}]) for q in questions]
    for decode in decoders.values():  # untimed warm-up: lazy initialisation, allocator
        decode(prompts[0], b.warmup_tokens)
    texts = [tokenizer.decode(p, skip_special_tokens=False) for p in prompts]
    if peer:
        peer.decode_all(texts[0], b.warmup_tokens, keep=False)
    names = list(decoders)
    runs: dict[str, list[Generation]] = {name: [] for name in names}
    ar_tokens: list[list[int]] = []
    n, step = b.max_new_tokens, 0
    progress = tqdm(total=b.repeats * len(prompts), desc="bench", unit="prompt")
    for _ in range(b.repeats):
        for prompt in prompts:
            order = names[step % len(names):] + names[: step % len(names)]  # rotate: no method always runs first
            for name in order:
                runs[name].append(decoders[name](prompt, n))
            ar_tokens.append(runs["ar"][-1].tokens)
            step += 1
            progress.update()
        for text in texts if peer else ():  # a phase of its own: nothing of polyspec's runs beside llama.cpp
            peer.decode_all(text, n)
    progress.close()
    summary = summarise(runs, ar_tokens, confidence)
    print(f"\n{step} prompts x {len(names)} methods, {n} new tokens, temperature {decoding.sampling.temperature}, "
          f"{torch.get_num_threads()} threads; medians (x AR = median per-prompt ratio; sb = Spec-Bench mean ratio; "
          f"time x AR = pooled seconds per token of AR over the method's, {confidence:.0%} paired interval over "
          f"prompts, + shown faster, - shown slower)")
    print(table(summary, notes))
    result = {"config": settings.config, "device": str(target.model.device),
              "threads": torch.get_num_threads(), "notes": notes, "summary": summary}
    if peer:
        ar_texts = [llamacpp.reply_text(tokenizer, tokens) for tokens in ar_tokens]
        result["llamacpp"] = {"summary": llamacpp.summary(peer, runs["ar"], ar_texts), "notes": peer.notes}
        policy = os.environ.get("OMP_WAIT_POLICY", "unset")
        print(f"\nllama.cpp in a phase of its own after polyspec's on the same prompts, {peer.threads} threads, the "
              f"same environment (OMP_WAIT_POLICY={policy}) for both engines")
        print(llamacpp.table(result["llamacpp"]["summary"], peer.notes))
    write_json_atomic(b.out, result)
    print(f"written {b.out}")
    return result


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_main(lambda: run(bench_of(cfg)))


def cli() -> None:
    main()


if __name__ == "__main__":
    cli()
