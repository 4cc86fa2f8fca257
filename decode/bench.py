"""`python -m decode.bench`: tokens/s and the ratio to plain autoregressive decoding, side by side.

Methods: AR (the target alone, KV cache), transformers assisted generation (the W4 model as the
assistant), transformers prompt lookup, the two-level chain, the three-level chain and any extra
chains (decode.bench.two_level / three_level / extra; a chain or assistant whose artifacts are
missing is replaced by its configured stand-in, and the table says so). All methods run in one
process, interleaved per prompt (the order rotates from prompt to prompt), and the table reports
medians, so machine noise hits every method alike (llama.cpp, where it runs, gets a phase of its own after
polyspec's methods in each round: the peer rows below), and each method's pooled time speedup over AR with its
paired interval over prompts (decode.evaluation.speedup, level decode.bench.confidence). Each chain's per-level
numbers and its measured decoding time next to both predictions (Theorem 3.1 and the refined one) come
from decode.evaluation.measure, the same code decode.eval reports them with.

llama.cpp beside polyspec (decode.bench.llamacpp): the same prompts, new-token count and threads, these ways.

  llamacpp_ar      the F32 target alone (llama-speculative-simple drafting nothing: plain greedy decoding)
  llamacpp_q8_0    the target quantized to Q8_0 by llama-quantize, alone: lossy with respect to the fp32 target
  llamacpp_q4_1    the bundled Q4_1 file the target comes from, alone: lossy, the model as it is distributed
  llamacpp_w4      the F32 target drafted for by the W4 level as a Q4_0 GGUF (exported exactly from the GPTQ
                   checkpoint; where the run has none, the bundled Q4_1 GGUF stands in, and the table says so)
  llamacpp_ngram   the F32 target drafted for by llama.cpp's n-gram mode

The drafting engines run at every draft length of decode.bench.llamacpp.sweep and the table gives each one's best
(bench.json keeps the sweep). Each engine is checked against llama.cpp's own AR (greedy: the same text; the lossy
rows are expected to differ), and its speed is given as a ratio to polyspec's AR and to llama.cpp's AR on the same
prompts in the same run. Times are llama.cpp's own (prompt evaluation plus decoding, model loading left out), as
polyspec's AR times prefill plus decoding.
"""
from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import hydra
import torch
from omegaconf import DictConfig
from tqdm import tqdm

from decode.chains.build import (
    ChainBuilder, builder_for, eos_of, level_model, load_target, onednn_target, reference_decoders,
)
from decode.engine.errors import DecodeError
from decode.engine.levels import Generation
from decode.engines.llamacpp import (
    LLAMACPP_AR, GgufExportError, LlamaOutput, LlamaPeer, Speculation, bundled_target, ensure_built, pooled_acceptance,
    quantized, same_greedy, usable, w4_gguf,
)
from decode.evaluation.measure import level_line, prediction_line, summarize
from decode.evaluation.speedup import Interval, time_speedup
from decode.settings import BenchSettings, Decoding, LlamaCppBench, bench_of
from infra.cli import check_writable, run_main
from infra.device import use_threads
from infra.layout import RunLayout

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

Method = Callable[[list[int], int], Generation]
Built = TypeVar("Built")


def with_stand_in(build: Callable[[Any, str], Built], wanted: Any, stand_in: Any, key: str,
                  what: str) -> tuple[Any, Built]:
    """`wanted` built (`key`: its config key), or where its artifacts are missing (a DecodeError or HeadError) the
    configured `stand_in` in its place (`<key>_stand_in`), with one line on stderr (`what`: the method and what it
    wanted); without a stand-in the error stands."""
    from heads.eagle import HeadError

    try:
        return wanted, build(wanted, key)
    except (DecodeError, HeadError) as err:
        if not stand_in:
            raise
        print(f"{what} unavailable ({err}); using stand-in {stand_in!r}", file=sys.stderr)
        return stand_in, build(stand_in, f"{key}_stand_in")


def assistant_method(settings: BenchSettings, builder: ChainBuilder, target: PreTrainedModel,
                     tokenizer: PreTrainedTokenizerBase) -> tuple[Method, str]:
    """transformers' assisted generation with decode.bench.assistant (or its stand-in), packed as the target is,
    and its note."""
    from decode.backends import Backend
    from decode.chains.baselines import hf_assisted
    from decode.engine.spec import LevelSpec, parse

    b, decoding = settings.section, settings.decoding
    eos, sampling = eos_of(target, tokenizer), decoding.sampling

    def load(level: dict[str, Any], key: str):
        return level_model(parse(LevelSpec, level, key), target, tokenizer, builder.artifacts, decoding.model.dtype)

    level, assistant = with_stand_in(load, b.assistant, b.assistant_stand_in, "decode.bench.assistant",
                                     "hf_assisted: assistant")
    Backend(builder.backend.gemm).prepare(assistant)
    return (lambda p, n: hf_assisted(target, assistant, p, n, sampling, eos_token_id=eos)), f"assistant {level}"


def methods(settings: BenchSettings, prepared, tokenizer) -> tuple[dict[str, Method], dict[str, str]]:
    """The decoders to compare, and a note per method on what it actually is (`prepared`: the configured target)."""
    from decode.backends.cpu.dense import packed_with
    from decode.chains.baselines import hf_prompt_lookup

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
        found["hf_assisted"], notes["hf_assisted"] = assistant_method(settings, builder, target, tokenizer)
    found["hf_prompt_lookup"] = lambda p, n: hf_prompt_lookup(target, p, n, b.prompt_lookup_num_tokens, sampling,
                                                              eos_token_id=eos)
    notes["hf_prompt_lookup"] = f"{b.prompt_lookup_num_tokens} tokens"
    slots = {"two_level": b.two_level, "three_level": b.three_level, **{name: name for name in b.extra}}
    for slot, name in slots.items():
        if name is None:
            continue
        name, chain = with_stand_in(lambda chain_name, _: builder.build(decoding.spec(chain_name)), name,
                                    b.stand_ins.get(name), f"decode.bench.{slot}", f"{slot}: chain {name!r}")
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
    """'<x>x [<low>, <high>]' and a mark when shown faster (+) or slower (-) than AR; '-' for AR itself."""
    if name == "ar":
        return "-"
    x = Interval.from_dict(s["time_speedup_interval"])
    return x.text() + (" +" if x.above_one else " -" if x.below_one else "  ")


# ------------------------------------------------------------------------------------------ llama.cpp beside


def bench_peer(decoding: Decoding, llamacpp: LlamaCppBench | None, threads: int) -> LlamaPeer | None:
    """decode.bench.llamacpp as a peer of `decoding`'s target, or None where it is off or cannot run (see usable)."""
    if llamacpp is None or not usable(llamacpp.enabled, decoding.model.name, decoding.model.dtype,
                                      "decode.bench.llamacpp.enabled"):
        return None
    tools = ensure_built()
    target = bundled_target(decoding.model.name)
    draft, draft_note = w4_draft(decoding.model.name, _w4_folder(decoding.layout), target)
    kind = str(llamacpp.ngram["kind"])
    ngram = {str(k): int(v) for k, v in llamacpp.ngram.items() if k != "kind"}
    models = {"llamacpp_q8_0": quantized(tools, target, "Q8_0"), "llamacpp_q4_1": _bundled_draft(decoding.model.name)}
    engines = {LLAMACPP_AR: Speculation()} | {name: Speculation() for name in models}
    engines |= {f"llamacpp_w4 k{k}": Speculation("draft-simple", draft=draft, draft_max=k) for k in llamacpp.sweep}
    drafts = {f"llamacpp_ngram k{k}": ngram | {"size-m": k} for k in llamacpp.sweep} if "size-m" in ngram \
        else {"llamacpp_ngram": ngram}  # size-m: the n-gram mode's draft length
    engines |= {name: Speculation(kind, ngram=tuple(sorted(values.items()))) for name, values in drafts.items()}
    notes = {LLAMACPP_AR: f"llama.cpp, {target.name} alone",
             **{name: f"{path.name} alone: lossy vs the fp32 target" for name, path in models.items()},
             "llamacpp_w4": draft_note, "llamacpp_ngram": f"{kind} {ngram}"}
    return LlamaPeer(tools, target, threads, engines, notes, models)


def w4_draft(model: str, w4_folder: Path | None, target: Path) -> tuple[Path, str]:
    """The W4 level's Q4_0 GGUF and a note; where the run has no W4 checkpoint that exports exactly, the bundled
    Q4_1 GGUF of `model` stands in and the note says why."""
    try:
        return w4_gguf(w4_folder, target), f"W4 Q4_0 GGUF from {w4_folder}"
    except GgufExportError as err:
        return _bundled_draft(model), f"stand-in: the bundled Q4_1 GGUF ({err})"


def _w4_folder(layout: RunLayout) -> Path | None:
    """The run's quantize.output, or None where the config sets none."""
    from infra.errors import ConfigError

    try:
        return layout.output("w4")
    except ConfigError:
        return None


def _bundled_draft(model: str) -> Path:
    from data.models import bundled_gguf

    return bundled_gguf(model.removeprefix("bundled:"))


def reply_text(tokenizer: Any, tokens: list[int]) -> str:
    """A polyspec reply as llama.cpp prints one: special tokens spelled out, the end-of-generation token left out."""
    if tokens and tokens[-1] == tokenizer.eos_token_id:
        tokens = tokens[:-1]
    return tokenizer.decode(tokens, skip_special_tokens=False)


def peer_summary(peer: LlamaPeer, polyspec_ar: list[Generation], polyspec_ar_texts: list[str]) -> dict[str, dict]:
    """Per engine, a sweep's fastest (by median tokens/s) standing for its family: median tokens/s, median
    per-prompt ratio to polyspec's AR and to llama.cpp's AR, how many outputs agree with llama.cpp's AR (the
    lossless check) and polyspec's AR (by text; see same_greedy), acceptance where it drafts; `sweep` gives every
    draft length's median tokens/s."""
    ar, n = peer.runs[LLAMACPP_AR], peer.new_tokens
    polyspec = [LlamaOutput(text, g.stats.new_tokens, 0, 0.0, 0.0) for text, g in zip(polyspec_ar_texts, polyspec_ar)]
    found = {}
    for name, outs in peer.runs.items():
        found[name] = {
            "median_tokens_per_s": statistics.median(o.tokens_per_s for o in outs),
            "median_ratio_vs_polyspec_ar": statistics.median(
                o.tokens_per_s / g.stats.tokens_per_s for o, g in zip(outs, polyspec_ar)),
            "median_ratio_vs_llamacpp_ar": statistics.median(o.tokens_per_s / a.tokens_per_s for o, a in zip(outs, ar)),
            "identical_to_llamacpp_ar": sum(same_greedy(o, a, n) for o, a in zip(outs, ar)),
            "same_text_as_polyspec_ar": sum(same_greedy(o, a, n) for o, a in zip(outs, polyspec)),
            "acceptance": pooled_acceptance(outs), "runs": len(outs),
            "new_tokens": sum(o.new_tokens for o in outs),
        }
    return best_of_sweeps(found)


def best_of_sweeps(found: dict[str, dict]) -> dict[str, dict]:
    """Engines named "<family> k<n>" folded into one row per family: the fastest, with `best` (its name) and
    `sweep` (every member's median tokens/s)."""
    families: dict[str, dict[str, dict]] = {}
    for name, row in found.items():
        families.setdefault(name.split(" ")[0], {})[name] = row
    folded = {}
    for family, rows in families.items():
        if len(rows) == 1 and family in rows:
            folded[family] = rows[family]
            continue
        best = max(rows, key=lambda n: rows[n]["median_tokens_per_s"])
        folded[family] = rows[best] | {"best": best, "sweep": {n: r["median_tokens_per_s"] for n, r in rows.items()}}
    return folded


def peer_table(found: dict[str, dict], notes: dict[str, str]) -> str:
    rows = [f"{'llama.cpp':<17} {'tok/s':>7} {'x AR':>6} {'x lcpp AR':>9} {'same':>6} {'accept':>7}  details"]
    for name, s in found.items():
        accept = f"{s['acceptance']:.0%}" if s["acceptance"] is not None else "-"
        best = f"best {s['best'].split(' ')[1]} of " + ", ".join(n.split(" ")[1] for n in s["sweep"]) + "; " \
            if "best" in s else ""
        rows.append(f"{name:<17} {s['median_tokens_per_s']:>7.2f} {s['median_ratio_vs_polyspec_ar']:>6.2f} "
                    f"{s['median_ratio_vs_llamacpp_ar']:>9.2f} {s['identical_to_llamacpp_ar']:>3}/{s['runs']:<2} "
                    f"{accept:>7}  {best}{notes.get(name, '')}; "
                    f"same text as polyspec AR {s['same_text_as_polyspec_ar']}/{s['runs']}")
    return "\n".join(rows)


# ------------------------------------------------------------------------------------------------ the app


def run(settings: BenchSettings) -> dict:
    from data.prompts import load_questions
    from data.sharegpt import chat_prompt_ids
    from infra.tracking import write_json_atomic

    b, decoding, confidence = settings.section, settings.decoding, settings.confidence
    check_writable(b.out, "decode.bench.out", kind="file")  # refuse before minutes of decoding, not after
    use_threads(decoding.section.threads, "decode.threads")
    questions = load_questions(b.prompts, per_category=b.per_category)  # before any model: a bad file fails fast
    peer = bench_peer(decoding, b.llamacpp, torch.get_num_threads())  # None (said why) where it is off
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
        ar_texts = [reply_text(tokenizer, tokens) for tokens in ar_tokens]
        result["llamacpp"] = {"summary": peer_summary(peer, runs["ar"], ar_texts), "notes": peer.notes}
        policy = os.environ.get("OMP_WAIT_POLICY", "unset")
        print(f"\nllama.cpp in a phase of its own after polyspec's on the same prompts, {peer.threads} threads, the "
              f"same environment (OMP_WAIT_POLICY={policy}) for both engines")
        print(peer_table(result["llamacpp"]["summary"], peer.notes))
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
