"""`python -m decode.eval`: measure the chains side by side, check them against Theorems 3.1-3.2, publish.

Every question (multi-turn ones with the reference answers as context, so every method sees the same
prompt) is decoded greedily by the autoregressive target and by every configured chain, interleaved,
after a warm-up. Three named checks decide whether the chain is published:
  lossless   every chain's output equals the AR output token for token (a divergence is excused only
             at a numerical near-tie of the target's top-2 logits, docs/design.md "What 'lossless' means");
  insertion  every level inserted between two others (a chain equal to another plus one middle level)
             lowers the time by Theorem 3.2 on the measured T and L;
  agreement  Theorem 3.1's speedup from the measured T_i, L_i agrees with the measured time speedup
             (AR seconds per token over the chain's, pooled) within a tolerance, and an insertion the
             theory admits is measured faster.
T_i is the engine's mean forward time (prefill forwards included, for AR and chains alike); L_i and
its variance pool every verification of the run (Theorem 3.3: the variance is reported per level).
Exit codes: 0 published, 1 bad input (one-line error), 2 a check failed and nothing was published.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from data.tracking import replace_dir
from decode.theory import TheoryError, insertion_conditions, insertion_improves, predicted_speedup, predicted_time


class EvalError(RuntimeError):
    """Bad eval input (config, chain, question file); the message is one line."""


# ---------------------------------------------------------------------------------------------- runner


@dataclass
class Record:
    """One decoded turn of one method: what it produced and what the engine measured."""

    question_id: Any
    category: str
    turn: int
    prompt_ids: list[int]
    tokens: list[int]
    wall_time_s: float
    levels: list[dict[str, Any]]  # name, kind, forward_calls, forward_time_s, acceptance_lengths
    draft_depth: float

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.wall_time_s if self.wall_time_s > 0 else 0.0


Decoder = Callable[[list[int], int], Any]  # (prompt_ids, max_new_tokens) -> Generation


def _record(question, turn: int, prompt_ids: list[int], generation) -> Record:
    stats = generation.stats
    levels = [
        {"name": l.name, "kind": l.kind, "forward_calls": l.forward_calls,
         "forward_time_s": l.draft_time_s + l.verify_time_s, "bookkeeping_time_s": l.bookkeeping_time_s,
         "acceptance_lengths": list(l.acceptance_lengths)}
        for l in stats.levels
    ]
    return Record(question.question_id, question.category, turn, list(prompt_ids), list(generation.tokens),
                  stats.wall_time_s, levels, stats.draft_depth)


def decode_questions(
    decoders: dict[str, Decoder], questions: list, tokenizer, max_new_tokens: int, warmup_tokens: int,
    reference: str = "ar",
) -> dict[str, list[Record]]:
    """Decode every turn of every question with every decoder, interleaved so CPU noise hits all alike."""
    from data.sharegpt import chat_prompt_ids

    if reference not in decoders:
        raise EvalError(f"the reference decoder {reference!r} is missing")
    first = chat_prompt_ids(tokenizer, [{"role": "user", "content": questions[0].turns[0]}])
    for decode in decoders.values():
        decode(first, warmup_tokens)
    records: dict[str, list[Record]] = {name: [] for name in decoders}
    progress = tqdm(questions, desc="eval", unit="question", file=sys.stderr)
    for question in progress:
        messages: list[dict[str, str]] = []
        for turn, text in enumerate(question.turns):
            messages.append({"role": "user", "content": text})
            prompt_ids = chat_prompt_ids(tokenizer, messages)
            for name, decode in decoders.items():
                records[name].append(_record(question, turn, prompt_ids, decode(prompt_ids, max_new_tokens)))
            answer = tokenizer.decode(records[reference][-1].tokens, skip_special_tokens=True)
            messages.append({"role": "assistant", "content": answer})
        progress.set_postfix({n: f"{r[-1].tokens_per_s:.1f}tok/s" for n, r in records.items()})
    return records


# ----------------------------------------------------------------------------------------- aggregation


def summarize(records: list[Record]) -> dict[str, Any]:
    """Pooled per-level T_i (total forward time / calls) and L_i (mean, variance over verifications)."""
    levels = []
    for i, first in enumerate(records[0].levels):
        calls = sum(r.levels[i]["forward_calls"] for r in records)
        fwd = sum(r.levels[i]["forward_time_s"] for r in records)
        lengths = [x for r in records for x in r.levels[i]["acceptance_lengths"]]
        hist: dict[int, int] = {}
        for x in lengths:
            hist[x] = hist.get(x, 0) + 1
        levels.append({
            "name": first["name"], "kind": first["kind"], "forward_calls": calls,
            "T_s": fwd / calls if calls else None,
            "L_mean": statistics.fmean(lengths) if lengths else None,
            "L_var": statistics.variance(lengths) if len(lengths) > 1 else None,
            "verifications": len(lengths), "L_histogram": dict(sorted(hist.items())),
            "bookkeeping_time_s": sum(r.levels[i]["bookkeeping_time_s"] for r in records),
        })
    rounds = levels[-2]["verifications"] if len(levels) > 1 else 0
    return {
        "levels": levels,
        "draft_depth": levels[-1]["forward_calls"] / rounds if rounds else None,
        "new_tokens": sum(len(r.tokens) for r in records),
        "wall_time_s": sum(r.wall_time_s for r in records),
        "tokens_per_s": statistics.fmean(r.tokens_per_s for r in records),
    }


def theory_inputs(summary: dict[str, Any]) -> tuple[list, list, Any]:
    """(forward_times, acceptance, draft_depth) for decode.theory from a chain's summary."""
    levels = summary["levels"]
    return [l["T_s"] for l in levels], [l["L_mean"] for l in levels[:-1]], summary["draft_depth"]


def speedup(records: list[Record], reference: list[Record]) -> float:
    """Spec-Bench's speedup: mean tokens/s over questions, over the reference's mean tokens/s."""
    return statistics.fmean(r.tokens_per_s for r in records) / statistics.fmean(r.tokens_per_s for r in reference)


def time_speedup(summary: dict[str, Any], reference: dict[str, Any]) -> float:
    """Seconds per token of the reference over the chain's, pooled over all turns: the quantity Theorem 3.1
    predicts (a total time), and robust to load that changes during the run since methods are interleaved."""
    return (reference["wall_time_s"] / reference["new_tokens"]) / (summary["wall_time_s"] / summary["new_tokens"])


def theory_for_chain(summary: dict[str, Any], ar_summary: dict[str, Any]) -> dict[str, Any]:
    """Theorem 3.1 on the measured values: predicted time and speedup, or the reason it cannot be evaluated."""
    try:
        times, lengths, beta = theory_inputs(summary)
        predicted = predicted_time(times, lengths, beta, summary["new_tokens"])
        return {
            "predicted_time_s": predicted,
            "prediction_error": predicted / summary["wall_time_s"] - 1,
            "predicted_speedup": predicted_speedup(times, lengths, beta, target_time=ar_summary["levels"][0]["T_s"]),
        }
    except TheoryError as err:
        return {"theory_error": str(err)}


def record_row(record: Record, reference: Record) -> dict[str, Any]:
    """One turn of one method for report.json: its speedup over the same turn's AR, T_i and L_i per level."""
    levels = summarize([record])["levels"]
    return {
        "question_id": record.question_id, "category": record.category, "turn": record.turn,
        "prompt_len": len(record.prompt_ids), "tokens": record.tokens, "wall_time_s": record.wall_time_s,
        "tokens_per_s": record.tokens_per_s, "speedup": record.tokens_per_s / reference.tokens_per_s if reference.tokens_per_s else None,
        "draft_depth": record.draft_depth,
        "levels": [{k: l[k] for k in ("name", "forward_calls", "T_s", "L_mean", "L_var")} | {"acceptance_lengths": raw["acceptance_lengths"]}
                   for l, raw in zip(levels, record.levels)],
    }


def by_category(records: dict[str, list[Record]], reference: str = "ar") -> dict[str, dict[str, Any]]:
    table: dict[str, dict[str, Any]] = {}
    for category in dict.fromkeys(r.category for r in records[reference]):
        ref = [r for r in records[reference] if r.category == category]
        row = {}
        for name, recs in records.items():
            mine = [r for r in recs if r.category == category]
            summary = summarize(mine)
            row[name] = {
                "tokens_per_s": summary["tokens_per_s"], "speedup": speedup(mine, ref),
                "T_s": [l["T_s"] for l in summary["levels"]], "L": [l["L_mean"] for l in summary["levels"][:-1]],
                "L_var": [l["L_var"] for l in summary["levels"][:-1]],
            }
        table[category] = row
    return table


# ---------------------------------------------------------------------------------------------- checks


@dataclass
class Check:
    name: str
    passed: bool
    reasons: list[str] = field(default_factory=list)  # one line per failure
    details: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "reasons": self.reasons, "details": self.details}


def top2_margin(target, ids: list[int]) -> tuple[float, list[int]]:
    """Relative gap of the target's two largest next-token logits after `ids`, and those two tokens."""
    with torch.inference_mode():
        logits = target(input_ids=torch.tensor([ids])).logits[0, -1].float()
    top = torch.topk(logits, 2)
    a, b = top.values.tolist()
    return (a - b) / max(abs(a), 1e-12), top.indices.tolist()


def check_lossless(
    records: dict[str, list[Record]], margin_fn: Callable[[list[int]], tuple[float, list[int]]],
    near_tie: float, reference: str = "ar",
) -> Check:
    """Token-for-token equality with the reference; a divergence at a near-tie is counted, not failed.

    `margin_fn(ids)` returns the target's relative top-2 margin after ids and its top-2 tokens. A tie
    excuses the rest of that turn (the texts legitimately part there); so does nothing else.
    """
    reasons, ties, compared = [], [], 0
    for name, recs in records.items():
        if name == reference:
            continue
        for mine, ref in zip(recs, records[reference]):
            compared += 1
            if mine.tokens == ref.tokens:
                continue
            where = f"{name}: question {ref.question_id} turn {ref.turn + 1}"
            pos = next((i for i, (a, b) in enumerate(zip(mine.tokens, ref.tokens)) if a != b), None)
            if pos is None:
                reasons.append(f"{where}: {len(mine.tokens)} tokens instead of {len(ref.tokens)}")
                continue
            margin, top2 = margin_fn(ref.prompt_ids + ref.tokens[:pos])
            if margin <= near_tie and {mine.tokens[pos], ref.tokens[pos]} <= set(top2):
                ties.append({"chain": name, "question_id": ref.question_id, "turn": ref.turn, "position": pos, "margin": margin})
            else:
                reasons.append(f"{where}: token {pos} is {mine.tokens[pos]}, AR has {ref.tokens[pos]} "
                               f"(target top-2 margin {margin:.2e} > near-tie tolerance {near_tie:.0e})")
    return Check("lossless", not reasons, reasons, {"compared_turns": compared, "near_ties": ties, "near_tie_tolerance": near_tie})


def find_insertions(chains: dict[str, list[str]]) -> list[dict[str, Any]]:
    """Pairs of chains that differ by one middle level: (with, without, index of the inserted level)."""
    found = []
    for with_name, names in chains.items():
        for without_name, base in chains.items():
            if len(names) != len(base) + 1:
                continue
            for j in range(1, len(names) - 1):
                if names[:j] + names[j + 1 :] == base:
                    found.append({"with": with_name, "without": without_name, "index": j, "level": names[j],
                                  "between": [names[j - 1], names[j + 1]]})
    return found


def evaluate_insertion(ins: dict[str, Any], summaries: dict[str, dict], rule: str) -> dict[str, Any]:
    """Theorem 3.2 (both closed forms) and the direct Theorem 3.1 comparison on measured values."""
    j, w, wo = ins["index"], summaries[ins["with"]], summaries[ins["without"]]
    values = {
        "T_i": wo["levels"][j - 1]["T_s"], "L_i_new": w["levels"][j - 1]["L_mean"], "T_new": w["levels"][j]["T_s"],
        "L_new": w["levels"][j]["L_mean"], "T_next": wo["levels"][j]["T_s"], "L_i": wo["levels"][j - 1]["L_mean"],
        "beta": w["draft_depth"],
    }
    try:
        closed = insertion_conditions(values["T_i"], values["L_i_new"], values["T_new"], values["L_new"],
                                      values["T_next"], values["L_i"], draft_depth=values["beta"], l_new_next=values["L_new"])
        direct = insertion_improves(theory_inputs(wo), theory_inputs(w))
    except TheoryError as err:
        return {**ins, "values": values, "error": str(err), "improves": False}
    verdict = {"theorem": closed.improves, "direct": direct.improves, "both": closed.improves and direct.improves}[rule]
    return {**ins, "values": values, "theorem_3_2": closed.as_dict(), "direct": direct.as_dict(), "rule": rule, "improves": verdict}


def check_insertion(insertions: list[dict[str, Any]]) -> Check:
    reasons = []
    for ins in insertions:
        if ins.get("error"):
            reasons.append(f"{ins['level']} in {ins['with']}: Theorem 3.2 cannot be evaluated ({ins['error']})")
        elif not ins["improves"]:
            t, d = ins["theorem_3_2"], ins["direct"]
            why = []
            if ins["rule"] in ("theorem", "both") and not t["improves"]:
                why.append(f"Theorem 3.2 fails both conditions (T_new/T_i {t['lhs_first']:.3f} >= {t['rhs_first']:.3f}, "
                           f"T_new/T_i+1 {t['lhs_second']:.3f} >= {t['rhs_second']:.3f})")
            if ins["rule"] in ("direct", "both") and not d["improves"]:
                why.append(f"Theorem 3.1 predicts {d['time_with'] * 1e3:.2f} ms/token with it vs "
                           f"{d['time_without'] * 1e3:.2f} ms without")
            reasons.append(f"{ins['level']} between {ins['between'][0]} and {ins['between'][1]} does not pay for "
                           f"itself: {'; '.join(why)}")
    return Check("insertion", not reasons, reasons, {"insertions": len(insertions)})


def check_agreement(chain_results: dict[str, dict[str, Any]], insertions: list[dict[str, Any]], tolerance: float) -> Check:
    """Theorem 3.1's predicted speedup against the measured time speedup, and the insertions' direction."""
    reasons = []
    for name, res in chain_results.items():
        if "theory_error" in res:
            reasons.append(f"{name}: Theorem 3.1 cannot be evaluated ({res['theory_error']})")
            continue
        error = res["predicted_speedup"] / res["time_speedup"] - 1
        res["speedup_error"] = error
        if abs(error) > tolerance:
            reasons.append(f"{name}: Theorem 3.1 predicts {res['predicted_speedup']:.2f}x, measured "
                           f"{res['time_speedup']:.2f}x ({error:+.0%}, tolerance {tolerance:.0%})")
    for ins in insertions:
        with_, without = chain_results[ins["with"]], chain_results[ins["without"]]
        if ins["improves"] and with_["time_speedup"] <= without["time_speedup"]:
            reasons.append(f"{ins['with']}: the theory says inserting {ins['level']} is faster, but it measured "
                           f"{with_['time_speedup']:.2f}x vs {without['time_speedup']:.2f}x for {ins['without']}")
    return Check("agreement", not reasons, reasons, {"tolerance": tolerance})


# -------------------------------------------------------------------------------------------- evaluate


def evaluate(
    records: dict[str, list[Record]], chains: dict[str, list[str]], margin_fn, checks_cfg: Any, reference: str = "ar",
) -> dict[str, Any]:
    """Everything the report holds, computed from the decoded records: summaries, theory, checks."""
    summaries = {name: summarize(recs) for name, recs in records.items()}
    chain_results = {}
    for name in chains:
        res = theory_for_chain(summaries[name], summaries[reference])
        res["measured_speedup"] = speedup(records[name], records[reference])
        res["time_speedup"] = time_speedup(summaries[name], summaries[reference])
        chain_results[name] = res
    baselines = {name: {"measured_speedup": speedup(records[name], records[reference]),  # e.g. ar_eager
                        "time_speedup": time_speedup(summaries[name], summaries[reference])}
                 for name in records if name != reference and name not in chains}
    insertions = [evaluate_insertion(ins, summaries, checks_cfg.insertion_rule) for ins in find_insertions(chains)]
    for ins in insertions:
        ins["speedups"] = {side: {"predicted": chain_results[ins[side]].get("predicted_speedup"),
                                  "measured": chain_results[ins[side]]["time_speedup"]} for side in ("without", "with")}
    checks = [
        check_lossless(records, margin_fn, checks_cfg.near_tie_relative, reference),
        check_insertion(insertions),
        check_agreement(chain_results, insertions, checks_cfg.agreement_tolerance),
    ]
    return {
        "summaries": summaries, "chains": chain_results, "baselines": baselines, "insertions": insertions,
        "categories": by_category(records, reference), "checks": [c.as_dict() for c in checks],
        "records": {name: [record_row(r, ref) for r, ref in zip(recs, records[reference])] for name, recs in records.items()},
    }


# ---------------------------------------------------------------------------------------------- publish


def folder_hash(path: str | Path) -> str:
    """Content hash of a folder: relative paths and bytes of every file, in sorted order (16 hex chars)."""
    h, root = hashlib.sha256(), Path(path)
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(root)).encode() + b"\0")
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


def library_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for dist in ("polyspec", "torch", "transformers", "gptqmodel", "optimum", "safetensors", "deepspeed", "hydra-core", "wandb"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = "not installed"
    return versions


def publish_bundle(
    publish_dir: str | Path, chain_json: dict[str, Any], report_dir: str | Path, folders: dict[str, str | Path],
) -> Path:
    """Write the bundle in a temp folder next to publish_dir and rename it into place (all or nothing).

    `folders` maps a level name to the folder to copy (the head, the W4 model): bundle/levels/<name>/.
    """
    final = Path(publish_dir)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        shutil.copytree(report_dir, tmp / "report")
        for name, folder in folders.items():
            shutil.copytree(folder, tmp / "levels" / name)
        (tmp / "chain.json").write_text(json.dumps(chain_json, indent=2, sort_keys=True, default=str) + "\n")
        replace_dir(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def failed_lines(checks: list[dict[str, Any]]) -> list[str]:
    return [f"check failed: {c['name']}: {reason}" for c in checks if not c["passed"] for reason in c["reasons"]]


def level_folder(level_cfg: Any, run_dir: str | Path) -> Path | None:
    """The folder a level loads from (head, W4 model), resolved as build_chain does; None for the target/specs."""
    kind = level_cfg.get("kind", "model")
    source = level_cfg.get("path") if kind == "eagle" else level_cfg.get("model") if kind == "model" else None
    if not source or source in ("target", "untrained") or str(source).startswith("bundled:"):
        return None
    path = Path(str(source)).expanduser()
    path = path if path.is_absolute() else Path(run_dir) / path
    return path if path.is_dir() else None


def chain_manifest(
    cfg: DictConfig, name: str, target_hash: str, report: dict[str, Any], forced: bool, failures: list[str],
) -> tuple[dict[str, Any], dict[str, Path]]:
    """chain.json for the published chain, and the level folders to copy into the bundle."""
    levels, folders = [], {}
    for level_cfg in cfg.eval.chains[name]:
        entry = {"config": OmegaConf.to_container(level_cfg, resolve=True)}
        folder = level_folder(level_cfg, cfg.run_dir)
        if folder is not None:
            entry |= {"source": str(folder), "content_hash": folder_hash(folder), "bundled_as": f"levels/{level_cfg.name}"}
            folders[level_cfg.name] = folder
        elif level_cfg.get("model") == "target":
            entry |= {"source": cfg.model.name, "dtype": cfg.model.dtype, "content_hash": target_hash}
        elif level_cfg.get("kind", "model") != "ngram":
            entry["source"] = str(level_cfg.get("model") or level_cfg.get("path"))  # a hub id, or `untrained`
        levels.append(entry)
    summary, result = report["summaries"][name], report["chains"][name]
    manifest = {
        "chain": name, "run_name": cfg.run_name, "levels": levels,
        "measured": {
            "speedup": result["measured_speedup"], "time_speedup": result["time_speedup"],
            "predicted_speedup": result.get("predicted_speedup"),
            "T_s": [l["T_s"] for l in summary["levels"]], "L": [l["L_mean"] for l in summary["levels"][:-1]],
            "draft_depth": summary["draft_depth"],
        },
        "checks": {c["name"]: c["passed"] for c in report["checks"]},
        "forced": forced, "failed_checks": failures, "versions": library_versions(),
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    return manifest, folders


def gate(checks: list[dict[str, Any]], force: bool) -> dict[str, Any]:
    failures = failed_lines(checks)
    if not failures:
        return {"publish": True, "forced": False, "failures": [], "decision": "published",
                "explanation": "every check passed."}
    if force:
        return {"publish": True, "forced": True, "failures": failures, "decision": "published (forced)",
                "explanation": f"publish.force=true overrode {len(failures)} failed check(s): " + " | ".join(failures)}
    return {"publish": False, "forced": False, "failures": failures, "decision": "not published",
            "explanation": f"{len(failures)} failed check(s): " + " | ".join(failures)}


def build_decoders(cfg: DictConfig, target, tokenizer) -> tuple[dict[str, Decoder], dict[str, list[str]]]:
    """The AR reference and every configured chain, as decoders; and each chain's level names."""
    from decode.baselines import autoregressive
    from decode.chain import build_chain

    eos = target.generation_config.eos_token_id if target.generation_config.eos_token_id is not None else tokenizer.eos_token_id
    decoders: dict[str, Decoder] = {"ar": lambda p, n: autoregressive(target, p, n, eos_token_id=eos)}
    if cfg.decode.get("fast"):  # the reference is the packed target; show what plain eager decoding costs too
        from data.models import load_model

        eager = load_model(cfg.model.name, cfg.model.dtype)[0]
        decoders["ar_eager"] = lambda p, n: autoregressive(eager, p, n, eos_token_id=eos)
    names: dict[str, list[str]] = {}
    for name, levels in cfg.eval.chains.items():
        if name == "ar":
            raise EvalError("eval.chains: 'ar' is reserved for the autoregressive reference")
        if levels is None:
            continue  # a chain switched off from the command line (eval.chains.polybasic=null)
        chain = build_chain(OmegaConf.to_container(levels, resolve=True), target, tokenizer, run_dir=cfg.run_dir,
                            dtype=cfg.model.dtype, fast=bool(cfg.decode.get("fast")))
        decoders[name] = lambda p, n, chain=chain: chain.generate(p, n, eos_token_id=eos)
        names[name] = [level.name for level in chain.levels]
    if not names:
        raise EvalError("eval.chains is empty: nothing to evaluate")
    return decoders, names


def run(cfg: DictConfig) -> int:
    from data.models import weights_hash
    from data.prompts import load_questions
    from decode.chain import load_target
    from data.tracking import Tracker
    from data.cli import check_writable, flag

    ecfg = cfg.eval
    for key, least in (("max_new_tokens", 1), ("warmup_tokens", 0)):
        value = ecfg.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise EvalError(f"eval.{key} must be >= {least} (an integer), got {value!r}")
    per_category = ecfg.get("per_category")
    if per_category is not None and (isinstance(per_category, bool) or not isinstance(per_category, int) or per_category < 1):
        raise EvalError(f"eval.per_category must be null or an integer >= 1, got {per_category!r}")
    flag(ecfg.publish, "force", error=EvalError)  # a string such as 'false' would be truthy
    flag(cfg.decode, "fast", default=False, error=EvalError)
    check_writable(ecfg.out_dir, "eval.out_dir", error=EvalError)  # fail now, not after the decoding
    check_writable(ecfg.publish.dir, "eval.publish.dir", error=EvalError)
    if ecfg.chains.get(ecfg.publish.chain) is None:
        raise EvalError(f"eval.publish.chain={ecfg.publish.chain!r} is not one of eval.chains ({', '.join(ecfg.chains)})")
    questions = load_questions(ecfg.prompts, ecfg.per_category)
    target, tokenizer = load_target(cfg)
    decoders, chains = build_decoders(cfg, target, tokenizer)
    tracker = Tracker(cfg, "eval")
    for art in ecfg.publish.lineage:  # this run consumed the head and the W4 model those stages logged
        tracker.use_artifact(art.name, art.type)
    records = decode_questions(decoders, questions, tokenizer, ecfg.max_new_tokens, ecfg.warmup_tokens)
    return conclude(cfg, records, chains, lambda ids: top2_margin(target, ids), weights_hash(target), tracker,
                    questions=len(questions))


def conclude(
    cfg: DictConfig, records: dict[str, list[Record]], chains: dict[str, list[str]],
    margin_fn: Callable[[list[int]], tuple[float, list[int]]], target_hash: str, tracker, questions: int,
) -> int:
    """From decoded records to the gate: evaluate, write the report, publish or refuse; the exit code."""
    from decode.report import write_report

    ecfg = cfg.eval
    near_tie = ecfg.checks.near_tie_relative.get(cfg.model.dtype)
    if near_tie is None:
        raise EvalError(f"eval.checks.near_tie_relative has no tolerance for dtype {cfg.model.dtype!r}")
    checks_cfg = OmegaConf.create({**OmegaConf.to_container(ecfg.checks), "near_tie_relative": near_tie})
    report = evaluate(records, chains, margin_fn, checks_cfg)
    decision = gate(report["checks"], bool(ecfg.publish.force))
    report |= {"run_name": cfg.run_name, "gate": decision, "config": OmegaConf.to_container(ecfg, resolve=True),
               "questions": questions, "max_new_tokens": ecfg.max_new_tokens}
    out = write_report(report, ecfg.out_dir)
    tracker.summary({
        **{f"{n}/speedup": r["measured_speedup"] for n, r in report["chains"].items()},
        **{f"{n}/time_speedup": r["time_speedup"] for n, r in report["chains"].items()},
        **{f"{n}/predicted_speedup": r.get("predicted_speedup") for n, r in report["chains"].items()},
        **{f"{n}/L_{i + 1}": l["L_mean"] for n in chains for i, l in enumerate(report["summaries"][n]["levels"][:-1])},
        **{f"{n}/T_{i + 1}_ms": (l["T_s"] or 0) * 1e3 for n in chains for i, l in enumerate(report["summaries"][n]["levels"])},
        **{f"{n}/{cat}/speedup": row[n]["speedup"] for cat, row in report["categories"].items() for n in chains},
        **{f"check/{c['name']}": c["passed"] for c in report["checks"]},
        "published": decision["publish"], "forced": decision["forced"],
    })
    tracker.log_artifact(out, name=f"eval-{cfg.run_name}", type="eval-report")
    print((out / "report.md").read_text())  # the summary a pipeline run ends with
    for line in decision["failures"]:
        print(line, file=sys.stderr)
    print(f"report: {out / 'report.md'}")
    if decision["publish"]:
        manifest, folders = chain_manifest(cfg, ecfg.publish.chain, target_hash, report, decision["forced"], decision["failures"])
        bundle = publish_bundle(ecfg.publish.dir, manifest, out, folders)
        tracker.log_artifact(bundle, name=f"chain-{cfg.run_name}", type="chain", metadata=manifest)
        print(f"published{' (FORCED despite failed checks)' if decision['forced'] else ''}: {bundle}")
    else:
        print(f"not published: {len(decision['failures'])} failed check(s)")
    tracker.finish(out / "metrics.json")
    return 0 if decision["publish"] else 2


def main() -> None:
    import hydra

    from data.models import ModelSourceError
    from data.sharegpt import DataError
    from decode.chain import DecodeError
    from decode.head import HeadError

    @hydra.main(version_base="1.3", config_path="../conf", config_name="config")
    def _main(cfg: DictConfig) -> None:
        try:
            code = run(cfg)
        except (EvalError, TheoryError, DecodeError, HeadError, ModelSourceError, DataError) as err:
            print(f"error: {err}", file=sys.stderr)
            code = 1
        sys.exit(code)

    _main()


if __name__ == "__main__":
    main()
