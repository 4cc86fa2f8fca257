"""llama.cpp beside polyspec in decode.bench: the same prompts, new-token count and threads, these ways.

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

import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from decode.engine.levels import Generation
from decode.consumers.llamacpp import (
    LlamaCppError, LlamaOutput, Speculation, decode, default_folder, ensure_built, is_ready, quantized, same_greedy,
)
from infra.layout import RunLayout

if TYPE_CHECKING:
    from decode.settings import Decoding, InteropSection, InteropSettings, LlamaCppBench

AR = "llamacpp_ar"


@dataclass
class LlamaPeer:
    """The llama.cpp engines to run per prompt, and what they produced."""

    tools: Path
    target: Path
    threads: int
    engines: dict[str, Speculation]  # a sweep's engines are named "<family> k<draft length>"
    notes: dict[str, str]
    models: dict[str, Path] = field(default_factory=dict)  # engines that decode another file than `target`
    runs: dict[str, list[LlamaOutput]] = field(default_factory=dict)
    new_tokens: int = 0  # the token limit of the kept runs

    def decode_all(self, prompt: str, new_tokens: int, keep: bool = True) -> None:
        """Every engine once on `prompt`; kept for the table unless `keep` is false (warm-up)."""
        for name, speculation in self.engines.items():
            model = self.models.get(name, self.target)
            out = decode(self.tools, model, prompt, new_tokens, self.threads, speculation)
            if keep:
                self.runs.setdefault(name, []).append(out)
                self.new_tokens = new_tokens


def usable(enabled: Any, model: str, dtype: str, key: str) -> bool:
    """Whether llama.cpp is to run (`key`: auto | true | false): false, a target that is not the bundled fp32
    GGUF, or (auto) no build yet each make it off, with one line on stderr but for false."""
    if not (isinstance(enabled, bool) or enabled == "auto"):
        raise LlamaCppError(f"{key} must be auto, true or false, got {enabled!r}")
    if enabled is False:
        return False
    if not model.startswith("bundled:") or dtype != "float32":
        print(f"llama.cpp: off (it runs the bundled fp32 target only; model {model}, {dtype})", file=sys.stderr)
        return False
    if enabled == "auto" and not is_ready(default_folder()):
        print(f"llama.cpp: off (not built in {default_folder()}; {key}=true builds it, once, tens of minutes)",
              file=sys.stderr)
        return False
    return True


def w4_draft(model: str, w4_folder: Path | None, target: Path) -> tuple[Path, str]:
    """The W4 level's Q4_0 GGUF and a note; where the run has no W4 checkpoint that exports exactly, the bundled
    Q4_1 GGUF of `model` stands in and the note says why."""
    from decode.consumers.llamacpp_gguf import GgufExportError, w4_gguf

    try:
        return w4_gguf(w4_folder, target), f"W4 Q4_0 GGUF from {w4_folder}"
    except GgufExportError as err:
        return _bundled_draft(model), f"stand-in: the bundled Q4_1 GGUF ({err})"


def bench_peer(decoding: Decoding, llamacpp: LlamaCppBench | None, threads: int) -> LlamaPeer | None:
    """decode.bench.llamacpp as a peer of `decoding`'s target, or None where it is off or cannot run (see usable)."""
    if llamacpp is None or not usable(llamacpp.enabled, decoding.model.name, decoding.model.dtype,
                                      "decode.bench.llamacpp.enabled"):
        return None
    tools = ensure_built()
    target = _target(decoding.model.name)
    draft, draft_note = w4_draft(decoding.model.name, _w4_folder(decoding.layout), target)
    kind = str(llamacpp.ngram["kind"])
    ngram = {str(k): int(v) for k, v in llamacpp.ngram.items() if k != "kind"}
    models = {"llamacpp_q8_0": quantized(tools, target, "Q8_0"), "llamacpp_q4_1": _bundled_draft(decoding.model.name)}
    engines = {AR: Speculation()} | {name: Speculation() for name in models}
    engines |= {f"llamacpp_w4 k{k}": Speculation("draft-simple", draft=draft, draft_max=k) for k in llamacpp.sweep}
    drafts = {f"llamacpp_ngram k{k}": ngram | {"size-m": k} for k in llamacpp.sweep} if "size-m" in ngram \
        else {"llamacpp_ngram": ngram}  # size-m: the n-gram mode's draft length
    engines |= {name: Speculation(kind, ngram=tuple(sorted(values.items()))) for name, values in drafts.items()}
    notes = {AR: f"llama.cpp, {target.name} alone",
             **{name: f"{path.name} alone: lossy vs the fp32 target" for name, path in models.items()},
             "llamacpp_w4": draft_note, "llamacpp_ngram": f"{kind} {ngram}"}
    return LlamaPeer(tools, target, threads, engines, notes, models)


def _checked_peer(section: InteropSection, target: Path, name: str, speculation: Speculation,
                  prompts: list[str]) -> tuple[LlamaPeer, int]:
    """llama.cpp's AR and `speculation` on decode.interop's prompts (after a warm-up), and on how many of them the
    two outputs are the same."""
    peer = LlamaPeer(ensure_built(), target, section.threads, {AR: Speculation(), name: speculation}, {})
    peer.decode_all(prompts[0], section.warmup_tokens, keep=False)
    for prompt in prompts:
        peer.decode_all(prompt, section.max_new_tokens)
    return peer, sum(same_greedy(a, b, peer.new_tokens) for a, b in zip(peer.runs[AR], peer.runs[name]))


def _target(model: str) -> Path:
    """The F32 GGUF of the bundled target `model`."""
    from decode.consumers.llamacpp_gguf import target_gguf

    return target_gguf(model.removeprefix("bundled:"))


def _enabled(settings: InteropSettings) -> bool:
    model = settings.decoding.model
    return usable(settings.section.llamacpp, model.name, model.dtype, "interop.llamacpp")


def w4_draft_check(settings: InteropSettings, w4_folder: Path, prompts: list[str]) -> dict[str, Any] | None:
    """decode.interop's check (c) in llama.cpp (all of it where vLLM cannot run the W4 model): the W4 level as a
    Q4_0 GGUF drafts for the F32 target, k tokens a step as the bundle's serve command has it (`k` in the result;
    decode.bench.llamacpp.draft_max); passed when it loads and every output equals llama.cpp's own AR. None where
    llama.cpp is off (interop.llamacpp)."""
    from decode.consumers.llamacpp_gguf import GgufExportError, w4_gguf

    if not _enabled(settings):
        return None
    target = _target(settings.decoding.model.name)
    try:
        draft = w4_gguf(w4_folder, target)
    except GgufExportError as err:
        return {"passed": False, "detail": f"llama.cpp: {err}"}
    k = settings.llamacpp_draft_max
    peer, same = _checked_peer(settings.section, target, "w4", Speculation("draft-simple", draft, k), prompts)
    acceptance = _acceptance(peer.runs["w4"])
    accepted = f"{acceptance:.0%} of drafted tokens accepted" if acceptance is not None else "no token drafted"
    detail = (f"llama.cpp loads {draft.name} as the draft model (k {k}): {same}/{len(prompts)} outputs equal its "
              f"AR, {accepted}")
    return {"passed": same == len(prompts), "detail": detail, "acceptance": acceptance, "identical": same, "k": k,
            "runs": {name: [vars(o) for o in outs] for name, outs in peer.runs.items()}}


def eagle3_head_check(settings: InteropSettings, head: Path, target: Path, prompts: list[str],
                      python: Path) -> dict[str, Any] | None:
    """decode.interop's head checks in llama.cpp: the EAGLE-3 head folder, converted by llama.cpp's own converter
    (run by `python`), drafts k tokens a step for the F32 target (`draft-eagle3`). Returns the outputs equal to
    llama.cpp's AR and its acceptance length, 1 + k x accepted / drafted (a chain of k drafted every step); None
    where llama.cpp is off."""
    from decode.consumers.llamacpp import convert_eagle3

    if not _enabled(settings):
        return None
    section = settings.section
    out = section.out.with_name("head.eagle3.gguf")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        gguf_head = convert_eagle3(head, target, out, python)
    except LlamaCppError as err:
        return {"error": str(err)}
    k = section.num_speculative_tokens
    peer, same = _checked_peer(section, _target(settings.decoding.model.name), "eagle3",
                               Speculation("draft-eagle3", gguf_head, k), prompts)
    acceptance = _acceptance(peer.runs["eagle3"])
    return {"gguf": str(gguf_head), "identical": same, "prompts": len(prompts), "acceptance": acceptance,
            "acceptance_length": 1 + k * (acceptance or 0.0),
            "runs": {name: [vars(o) for o in outs] for name, outs in peer.runs.items()}}


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


def summary(peer: LlamaPeer, polyspec_ar: list[Generation], polyspec_ar_texts: list[str]) -> dict[str, dict]:
    """Per engine, a sweep's fastest (by median tokens/s) standing for its family: median tokens/s, median
    per-prompt ratio to polyspec's AR and to llama.cpp's AR, how many outputs agree with llama.cpp's AR (the
    lossless check) and polyspec's AR (by text; see same_greedy), acceptance where it drafts; `sweep` gives every
    draft length's median tokens/s."""
    ar, n = peer.runs[AR], peer.new_tokens
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
            "acceptance": _acceptance(outs), "runs": len(outs),
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


def _acceptance(outs: list[LlamaOutput]) -> float | None:
    drafted = sum(o.drafted for o in outs)
    return sum(o.accepted for o in outs) / drafted if drafted else None


def table(found: dict[str, dict], notes: dict[str, str]) -> str:
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
