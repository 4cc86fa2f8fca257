"""`python -m decode.eval`: measure the chains side by side, check them against Theorems 3.1-3.2, publish.

Every question (multi-turn ones with the reference answers as context, so every method sees the same
prompt) is decoded greedily by the autoregressive target and by every configured chain, interleaved,
after a warm-up. Three named checks and the speed decide which chain is published:
  lossless   every chain's output equals the AR output token for token (a divergence is excused only
             at a numerical near-tie of the target's top-2 logits, docs/design.md "What 'lossless' means");
  insertion  every level inserted between two others (a chain equal to another plus one middle level)
             lowers the time by Theorem 3.2 on the measured T and L;
  agreement  the refined prediction of each chain's decoding time (decode.measure; Theorem 3.1 with each
             level's rounds counted from what it hands up) is within a tolerance of the measured time,
             and an insertion the theory admits is measured faster. Theorem 3.1's own error is reported.
Before decoding, decode.plan calibrates each chain on held-out prompts and picks mu and the draft
length or tree size; a plan that changes them is decoded too, as `<chain>_planned`. A chain is
admissible when no check failed for it and it measured faster than AR; the fastest admissible one is
published (eval.publish.chain=<chain>: that chain only, and only if every check passed).
T_i is the engine's mean forward time; L_i and its variance pool every verification of the run, and
Theorem 3.3 compares that variance with a sampled decode (temperature 1) per level.
Exit codes (data/cli.py, README): 0 published, 2 bad input (a one-line error), 3 no chain admissible and nothing
published.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from data.artifacts import Artifacts
from data.cli import EXIT_NOT_PUBLISHED, PolyspecError, run_main
from data.tracking import atomic_dir
from decode import measure
from decode.theory import TheoryError, insertion_conditions, insertion_improves


class EvalError(PolyspecError, RuntimeError):
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
    stats: Any  # decode.chain.GenerationStats

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.stats.wall_time_s if self.stats.wall_time_s > 0 else 0.0


Decoder = Callable[..., Any]  # (prompt_ids, max_new_tokens, **sampling) -> Generation


def _record(question, turn: int, prompt_ids: list[int], generation) -> Record:
    return Record(question.question_id, question.category, turn, list(prompt_ids), list(generation.tokens), generation.stats)


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


def decode_sampled(decoders: dict[str, Decoder], questions: list, tokenizer, max_new_tokens: int, temperature: float,
                   seed: int) -> dict[str, list[Record]]:
    """First turns decoded by sampling (Theorem 3.3's side of the comparison; the greedy side is the main run)."""
    from data.sharegpt import chat_prompt_ids

    records: dict[str, list[Record]] = {name: [] for name in decoders}
    for i, question in enumerate(questions):
        prompt_ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": question.turns[0]}])
        for name, decode in decoders.items():
            generation = decode(prompt_ids, max_new_tokens, temperature=temperature, seed=seed + i)
            records[name].append(_record(question, 0, prompt_ids, generation))
    return records


# ----------------------------------------------------------------------------------------- aggregation


def summarize(records: list[Record]) -> dict[str, Any]:
    """decode.measure's pooled per-level numbers and both predictions, over these turns."""
    return measure.summarize([r.stats for r in records])


def theory_inputs(summary: dict[str, Any]) -> tuple[list, list, Any]:
    """(forward_times, acceptance, draft_depth) for decode.theory from a chain's summary."""
    levels = summary["levels"]
    return [l["T_s"] for l in levels], [l["L_mean"] for l in levels[:-1]], summary["draft_depth"]


def speedup(records: list[Record], reference: list[Record]) -> float:
    """Spec-Bench's speedup: mean tokens/s over questions, over the reference's mean tokens/s."""
    return statistics.fmean(r.tokens_per_s for r in records) / statistics.fmean(r.tokens_per_s for r in reference)


def time_speedup(summary: dict[str, Any], reference: dict[str, Any]) -> float:
    """Seconds per token of the reference over the chain's, pooled over all turns (prefill included: what
    a user waits), and robust to load that changes during the run since methods are interleaved."""
    return (reference["wall_time_s"] / reference["new_tokens"]) / (summary["wall_time_s"] / summary["new_tokens"])


def chain_result(summary: dict[str, Any], ar: dict[str, Any]) -> dict[str, Any]:
    """Both predictions of a chain's decoding time, each also as a speedup over AR (AR's measured seconds
    per forward, one forward per token, over the predicted seconds per token)."""
    predictions = {}
    for name, p in summary["predictions"].items():
        predictions[name] = dict(p)
        if "time_s" in p and ar["levels"][0]["T_s"]:
            predictions[name]["speedup"] = ar["levels"][0]["T_s"] * summary["decode_tokens"] / p["time_s"]
    return {"predictions": predictions, "decode_time_s": summary["decode_time_s"]}


def record_row(record: Record, reference: Record) -> dict[str, Any]:
    """One turn of one method for report.json: its speedup over the same turn's AR, T_i and L_i per level,
    and both predictions of its decoding time."""
    summary = summarize([record])
    return {
        "question_id": record.question_id, "category": record.category, "turn": record.turn,
        "prompt_len": len(record.prompt_ids), "tokens": record.tokens, "wall_time_s": record.stats.wall_time_s,
        "decode_time_s": summary["decode_time_s"], "tokens_per_s": record.tokens_per_s,
        "speedup": record.tokens_per_s / reference.tokens_per_s if reference.tokens_per_s else None,
        "draft_depth": summary["draft_depth"],
        "predicted_time_s": {name: p.get("time_s") for name, p in summary["predictions"].items()},
        "levels": [{k: l[k] for k in ("name", "forward_calls", "T_s", "L_mean", "L_var")} | {"acceptance_lengths": list(raw.acceptance_lengths)}
                   for l, raw in zip(summary["levels"], record.stats.levels)],
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
    by_chain: dict[str, list[str]] = field(default_factory=dict)  # each failure, under the chain it rules out
    details: dict[str, Any] = field(default_factory=dict)

    def fail(self, chain: str, reason: str) -> None:
        self.by_chain.setdefault(chain, []).append(reason)

    @property
    def reasons(self) -> list[str]:  # one line per failure
        return [r for reasons in self.by_chain.values() for r in reasons]

    @property
    def passed(self) -> bool:
        return not self.by_chain

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "reasons": self.reasons, "by_chain": self.by_chain, "details": self.details}


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
    check, ties, compared = Check("lossless"), [], 0
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
                check.fail(name, f"{where}: {len(mine.tokens)} tokens instead of {len(ref.tokens)}")
                continue
            margin, top2 = margin_fn(ref.prompt_ids + ref.tokens[:pos])
            if margin <= near_tie and {mine.tokens[pos], ref.tokens[pos]} <= set(top2):
                ties.append({"chain": name, "question_id": ref.question_id, "turn": ref.turn, "position": pos, "margin": margin})
            else:
                check.fail(name, f"{where}: token {pos} is {mine.tokens[pos]}, AR has {ref.tokens[pos]} "
                                 f"(target top-2 margin {margin:.2e} > near-tie tolerance {near_tie:.0e})")
    check.details = {"compared_turns": compared, "near_ties": ties, "near_tie_tolerance": near_tie}
    return check


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
    check = Check("insertion", details={"insertions": len(insertions)})
    for ins in insertions:
        if ins.get("error"):
            check.fail(ins["with"], f"{ins['level']} in {ins['with']}: Theorem 3.2 cannot be evaluated ({ins['error']})")
        elif not ins["improves"]:
            t, d = ins["theorem_3_2"], ins["direct"]
            why = []
            if ins["rule"] in ("theorem", "both") and not t["improves"]:
                why.append(f"Theorem 3.2 fails both conditions (T_new/T_i {t['lhs_first']:.3f} >= {t['rhs_first']:.3f}, "
                           f"T_new/T_i+1 {t['lhs_second']:.3f} >= {t['rhs_second']:.3f})")
            if ins["rule"] in ("direct", "both") and not d["improves"]:
                why.append(f"Theorem 3.1 predicts {d['time_with'] * 1e3:.2f} ms/token with it vs "
                           f"{d['time_without'] * 1e3:.2f} ms without")
            check.fail(ins["with"], f"{ins['level']} between {ins['between'][0]} and {ins['between'][1]} does not pay "
                                    f"for itself: {'; '.join(why)}")
    return check


PREDICTIONS = {"refined": "the refined prediction", "paper": "Theorem 3.1"}


def check_agreement(
    chain_results: dict[str, dict[str, Any]], insertions: list[dict[str, Any]], tolerance: float, prediction: str = "refined",
) -> Check:
    """A prediction of each chain's decoding time (refined by default) against the measured one, and an
    insertion the theory admits measured faster."""
    if prediction not in PREDICTIONS:
        raise EvalError(f"eval.checks.agreement_prediction must be one of {', '.join(PREDICTIONS)}, got {prediction!r}")
    check, label = Check("agreement", details={"prediction": prediction, "tolerance": tolerance}), PREDICTIONS[prediction]
    for name, res in chain_results.items():
        p = res["predictions"][prediction]
        if p.get("error") is None:
            check.fail(name, f"{name}: {label} cannot be evaluated ({p.get('error_reason', 'no decoding time measured')})")
        elif abs(p["error"]) > tolerance:
            check.fail(name, f"{name}: {label} predicts {p['time_s']:.2f}s of decoding, measured {res['decode_time_s']:.2f}s "
                             f"({p['error']:+.0%}, tolerance {tolerance:.0%})")
    for ins in insertions:
        with_, without = chain_results[ins["with"]], chain_results[ins["without"]]
        if ins["improves"] and with_["time_speedup"] <= without["time_speedup"]:
            check.fail(ins["with"], f"{ins['with']}: the theory says inserting {ins['level']} is faster, but it measured "
                                    f"{with_['time_speedup']:.2f}x vs {without['time_speedup']:.2f}x for {ins['without']}")
    return check


def theorem_3_3(greedy: dict[str, list[Record]], sampled: dict[str, list[Record]]) -> dict[str, list[dict[str, Any]]]:
    """Per chain and verifying level, acceptance length (mean, variance) greedy vs sampling on the same turns."""
    out = {}
    for name, recs in sampled.items():
        turns = {(r.question_id, r.turn) for r in recs}
        same = [r for r in greedy[name] if (r.question_id, r.turn) in turns]
        if not recs or not same:
            continue
        pair = summarize(same), summarize(recs)
        rows = []
        for g, s in zip(pair[0]["levels"][:-1], pair[1]["levels"][:-1]):
            row = {"level": g["name"], **{side: {"L": l["L_mean"], "var": l["L_var"], "verifications": l["verifications"]}
                                          for side, l in (("greedy", g), ("sampling", s))}}
            row["claim_holds"] = None if None in (g["L_var"], s["L_var"]) else s["L_var"] < g["L_var"]
            rows.append(row)
        out[name] = rows
    return out


# -------------------------------------------------------------------------------------------- evaluate


def evaluate(
    records: dict[str, list[Record]], chains: dict[str, list[str]], margin_fn, checks_cfg: Any, reference: str = "ar",
    plans: dict[str, dict[str, Any]] | None = None, sampled: dict[str, list[Record]] | None = None,
) -> dict[str, Any]:
    """Everything the report holds, computed from the decoded records: summaries, theory, checks, plans.

    `plans` maps a configured chain to its plan (decode.plan.plan_chain, plus "chain": the planned chain's
    name); insertions pair configured chains with configured ones and planned with planned."""
    plans = plans or {}
    summaries = {name: summarize(recs) for name, recs in records.items()}
    chain_results = {}
    for name in chains:
        res = chain_result(summaries[name], summaries[reference])
        res["measured_speedup"] = speedup(records[name], records[reference])
        res["time_speedup"] = time_speedup(summaries[name], summaries[reference])
        chain_results[name] = res
    baselines = {name: {"measured_speedup": speedup(records[name], records[reference]),  # e.g. ar_eager
                        "time_speedup": time_speedup(summaries[name], summaries[reference])}
                 for name in records if name != reference and name not in chains}
    planned = {plan["chain"] for base, plan in plans.items() if plan["chain"] != base}
    groups = [[n for n in chains if n not in planned], [plan["chain"] for plan in plans.values()]]
    pairs = {(i["with"], i["without"], i["index"]): i for g in groups for i in find_insertions({n: chains[n] for n in g})}
    insertions = [evaluate_insertion(ins, summaries, checks_cfg.insertion_rule) for ins in pairs.values()]
    for ins in insertions:
        ins["speedups"] = {side: {"predicted": chain_results[ins[side]]["predictions"]["paper"].get("speedup"),
                                  "measured": chain_results[ins[side]]["time_speedup"]} for side in ("without", "with")}
    per_token = {name: s["decode_time_s"] / max(s["decode_tokens"], 1) for name, s in summaries.items()}
    for base, plan in plans.items():  # the planner's predictions against what the chains measured
        for side, name in (("configured", base), ("planned", plan["chain"])):
            plan[side] |= {"measured_s_per_token": per_token[name], "measured_speedup": per_token[reference] / per_token[name],
                           "error": plan[side]["predicted"]["s_per_token"] / per_token[name] - 1}
    checks = [
        check_lossless(records, margin_fn, checks_cfg.near_tie_relative, reference),
        check_insertion(insertions),
        check_agreement(chain_results, insertions, checks_cfg.agreement_tolerance, checks_cfg.get("agreement_prediction", "refined")),
    ]
    return {
        "summaries": summaries, "chains": chain_results, "baselines": baselines, "insertions": insertions, "plans": plans,
        "theorem_3_3": theorem_3_3(records, sampled or {}),
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
    with atomic_dir(final) as tmp:
        shutil.copytree(report_dir, tmp / "report")
        for name, folder in folders.items():
            shutil.copytree(folder, tmp / "levels" / name)
        (tmp / "chain.json").write_text(json.dumps(chain_json, indent=2, sort_keys=True, default=str) + "\n")
    return final


def failed_lines(checks: list[dict[str, Any]]) -> list[str]:
    return [f"check failed: {c['name']}: {reason}" for c in checks if not c["passed"] for reason in c["reasons"]]


def level_folder(level_cfg: Any, artifacts: Artifacts) -> Path | None:
    """The folder a level loads from (head, W4 model), resolved as decode.build does; None for the target,
    `untrained` and models that are no folder (bundled:, hub ids)."""
    kind = level_cfg.get("kind", "model")
    source = level_cfg.get("path") if kind == "eagle" else level_cfg.get("model") if kind == "model" else None
    if not source or source in ("target", "untrained"):
        return None
    path = Path(artifacts.model_spec(str(source))) if kind == "model" else artifacts.folder(str(source))
    return path if path.is_dir() else None


def chain_manifest(
    cfg: DictConfig, name: str, level_cfgs: list[dict[str, Any]], target_hash: str, report: dict[str, Any],
    decision: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, Path]]:
    """chain.json for the published chain (its levels as decoded, planned values included), and the level
    folders to copy into the bundle."""
    levels, folders, artifacts = [], {}, Artifacts.of(cfg)
    for i, level_cfg in enumerate(level_cfgs):
        entry, label = {"config": level_cfg}, level_cfg.get("name") or f"L{i + 1}"
        folder = level_folder(level_cfg, artifacts)
        if folder is not None:
            entry |= {"source": str(folder), "content_hash": folder_hash(folder), "bundled_as": f"levels/{label}"}
            folders[label] = folder
        elif level_cfg.get("model") == "target":
            entry |= {"source": cfg.model.name, "dtype": cfg.model.dtype, "content_hash": target_hash}
        elif level_cfg.get("kind", "model") != "ngram":
            entry["source"] = str(level_cfg.get("model") or level_cfg.get("path"))  # a hub id, or `untrained`
        levels.append(entry)
    summary, result = report["summaries"][name], report["chains"][name]
    plan = next(({"base": base, "published": "planned" if name != base else "configured", **p}
                 for base, p in report["plans"].items() if name in (base, p["chain"])), None)
    manifest = {
        "chain": name, "run_name": cfg.run_name, "levels": levels, "plan": plan,
        "measured": {
            "speedup_over_ar": result["time_speedup"], "spec_bench_speedup": result["measured_speedup"],
            "decode_time_s": result["decode_time_s"],
            "predicted_decode_time_s": {k: p.get("time_s") for k, p in result["predictions"].items()},
            "T_s": [l["T_s"] for l in summary["levels"]], "L": [l["L_mean"] for l in summary["levels"][:-1]],
            "draft_depth": summary["draft_depth"],
        },
        "checks": {c["name"]: name not in c["by_chain"] for c in report["checks"]} | {"faster_than_ar": result["time_speedup"] > 1},
        "forced": decision["forced"], "rejected": decision["rejected"], "failed_checks": decision["failures"],
        "versions": library_versions(), "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "serve": serve_of(cfg, levels),
    }
    return manifest, folders


def serve_of(cfg: DictConfig, levels: list[dict[str, Any]]) -> dict[str, Any]:
    """chain.json's `serve` (decode.serving) for the published bundle's target, drafter and W4 level, by their
    paths once published."""
    from data.models import ModelSourceError, resolve_model_path
    from decode.serving import serve_section

    bundle = Path(cfg.eval.publish.dir).resolve()
    where = [str(bundle / l["bundled_as"]) if "bundled_as" in l else None for l in levels]
    try:
        target = resolve_model_path(cfg.model.name)  # the folder a bundled target was converted into
    except ModelSourceError:
        target = cfg.model.name
    return serve_section(target, cfg.model.dtype, levels[-1]["config"], where[-1], next(filter(None, where[1:-1]), None))


def gate(checks: list[dict[str, Any]], speedups: dict[str, float], choice: str = "best", force: bool = False) -> dict[str, Any]:
    """Which chain to publish, if any. `speedups`: each chain's measured time speedup over AR.

    A chain is admissible when no check failed for it (lossless, insertion of its levels, agreement) and
    it measured faster than AR. choice=best publishes the fastest admissible chain; choice=<chain> is the
    strict gate: that chain, only if it is faster than AR and every check of every chain passed.
    force=true overrides failed checks, never the speed: a chain slower than AR is never published."""
    failures, strict_ok = failed_lines(checks), not failed_lines(checks)
    rejected = {n: [f"{c['name']}: {r}" for c in checks for r in c["by_chain"].get(n, [])] for n in speedups}
    for n, x in speedups.items():
        if x <= 1:
            rejected[n].append(f"faster than AR: measured {x:.2f}x AR")
            failures.append(f"check failed: faster than AR: {n} measured {x:.2f}x AR (a chain slower than AR is never published)")
    fast = [n for n, x in speedups.items() if x > 1]
    if choice == "best":
        admissible = [n for n in fast if not rejected[n]]
        pool = admissible or (fast if force else [])
    else:
        admissible = [choice] if choice in fast and strict_ok else []
        pool = [choice] if choice in fast and (strict_ok or force) else []
    chain = max(pool, key=speedups.__getitem__, default=None)
    forced = chain is not None and chain not in admissible
    if chain is None:
        decision = "not published"
        explanation = ("no chain is admissible." if choice == "best" else
                       f"eval.publish.chain={choice} (strict): " + ("it measured slower than AR." if choice not in fast
                                                                    else "a check failed; the strict gate needs every check to pass."))
    elif forced:
        decision = "published (forced)"
        explanation = f"{chain} ({speedups[chain]:.2f}x AR): publish.force=true overrode: " + " | ".join(rejected[chain] or failures)
    else:
        decision = "published"
        explanation = (f"{chain}, the fastest admissible chain: {speedups[chain]:.2f}x AR measured." if choice == "best"
                       else f"{chain}: every check passed and it measured {speedups[chain]:.2f}x AR.")
    return {"publish": chain is not None, "chain": chain, "choice": choice, "forced": forced, "admissible": admissible,
            "rejected": {n: r for n, r in rejected.items() if r}, "failures": failures, "decision": decision,
            "explanation": explanation}


def clean_stale(outputs: list[str | Path]) -> list[Path]:
    """Remove the temp folders an interrupted eval left next to its outputs (.eval.tmp-*, .publish.old-*)."""
    removed = []
    for out in map(Path, outputs):
        for pattern in (f".{out.name}.tmp-*", f".{out.name}.old-*"):
            for stale in out.parent.glob(pattern):
                shutil.rmtree(stale, ignore_errors=True)
                removed.append(stale)
    return removed


def set_aside(publish_dir: str | Path) -> Path | None:
    """After a refused publish the previous bundle must not look current: move it to <dir>.stale."""
    final = Path(publish_dir)
    if not final.exists():
        return None
    stale = final.with_name(f"{final.name}.stale")
    shutil.rmtree(stale, ignore_errors=True)
    final.rename(stale)
    return stale


def eos_of(target, tokenizer) -> Any:
    return target.generation_config.eos_token_id if target.generation_config.eos_token_id is not None else tokenizer.eos_token_id


def chain_decoder(chain, eos: Any, values: dict[str, Any] | None = None) -> Decoder:
    """Decode with `chain`, first setting its mu and draft to `values` (a planned chain shares the configured
    one's levels and loaded models)."""
    def decode(prompt_ids: list[int], max_new_tokens: int, **sampling):
        if values is not None:
            from decode.plan import apply

            apply(chain, values)
        return chain.generate(prompt_ids, max_new_tokens, eos_token_id=eos, **sampling)

    return decode


def build_decoders(cfg: DictConfig, target, tokenizer) -> tuple[dict[str, Decoder], dict[str, Any]]:
    """The AR reference and every configured chain, as decoders; and the built chains."""
    from decode.baselines import autoregressive
    from decode.build import configured_chain

    eos = eos_of(target, tokenizer)
    decoders: dict[str, Decoder] = {"ar": lambda p, n: autoregressive(target, p, n, eos_token_id=eos)}
    if cfg.decode.get("fast"):  # the reference is the packed target; show what plain eager decoding costs too
        from data.models import load_model

        eager = load_model(cfg.model.name, cfg.model.dtype)[0]
        decoders["ar_eager"] = lambda p, n: autoregressive(eager, p, n, eos_token_id=eos)
    built = {}
    for name, levels in cfg.eval.chains.items():
        if name == "ar":
            raise EvalError("eval.chains: 'ar' is reserved for the autoregressive reference")
        if levels is None:
            continue  # a chain switched off from the command line (eval.chains.polybasic=null)
        built[name] = configured_chain(cfg, OmegaConf.to_container(levels, resolve=True), target, tokenizer)
        decoders[name] = chain_decoder(built[name], eos)
    if not built:
        raise EvalError("eval.chains is empty: nothing to evaluate")
    return decoders, built


def calibration_prompts(ecfg: Any, questions: list, tokenizer) -> list[list[int]]:
    """First turns of questions the eval does not decode (categories in turn), else of the eval's own."""
    from data.prompts import load_questions
    from data.sharegpt import chat_prompt_ids

    used = {q.question_id for q in questions}
    held_out = [q for q in load_questions(ecfg.prompts) if q.question_id not in used] or questions
    seen: dict[str, int] = {}
    ranked = []
    for q in held_out:
        seen[q.category] = seen.get(q.category, 0) + 1
        ranked.append((seen[q.category], q))
    picked = [q for _, q in sorted(ranked, key=lambda r: r[0])][: int(ecfg.plan.questions)]
    return [chat_prompt_ids(tokenizer, [{"role": "user", "content": q.turns[0]}]) for q in picked]


def planned_levels(levels_cfg: Any, values: dict[str, Any]) -> list[dict[str, Any]]:
    """The chain's level configs with the planned mu of every middle level and the planned draft."""
    levels = OmegaConf.to_container(levels_cfg, resolve=True)
    for level, mu in zip(levels[1:-1], values["mu"].values()):
        level["mu"] = mu
    levels[-1]["draft"] = dict(values["draft"])
    return levels


def plan_chains(cfg: DictConfig, built: dict[str, Any], decoders: dict[str, Decoder], questions: list, tokenizer,
                eos: Any) -> dict[str, dict[str, Any]]:
    """Plan the chains of eval.plan.chains (null: all) on held-out prompts. A plan that changes the knobs adds
    the decoder `<chain>_planned`, decoded next to the configured chain."""
    from decode.plan import plan_chain

    pcfg, plans = cfg.eval.plan, {}
    prompts = calibration_prompts(cfg.eval, questions, tokenizer)
    for name in pcfg.chains or list(built):
        if name not in built:
            raise EvalError(f"eval.plan.chains: {name!r} is not one of eval.chains ({', '.join(built)})")
        print(f"plan: calibrating {name} on {len(prompts)} held-out prompts", file=sys.stderr)
        plan = plan_chain(built[name], prompts, pcfg, eos)
        values = plan["planned"]["knobs"]
        planned = name if values == plan["configured"]["knobs"] else f"{name}_planned"
        decoders[name] = chain_decoder(built[name], eos, plan["configured"]["knobs"])
        if planned != name:
            decoders[planned] = chain_decoder(built[name], eos, values)
        plans[name] = plan | {"chain": planned, "levels": planned_levels(cfg.eval.chains[name], values)}
    return plans


def run(cfg: DictConfig) -> int:
    from data.models import weights_hash
    from data.prompts import load_questions
    from decode.build import load_target
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
    if ecfg.publish.chain != "best" and ecfg.chains.get(ecfg.publish.chain) is None:
        raise EvalError(f"eval.publish.chain={ecfg.publish.chain!r} is not one of eval.chains ({', '.join(ecfg.chains)}) nor 'best'")
    questions = load_questions(ecfg.prompts, ecfg.per_category)
    if cfg.decode.get("threads"):
        torch.set_num_threads(int(cfg.decode.threads))
    target, tokenizer = load_target(cfg)
    decoders, built = build_decoders(cfg, target, tokenizer)
    tracker = Tracker(cfg, "eval")
    for art in ecfg.publish.lineage:  # this run consumed the head and the W4 model those stages logged
        tracker.use_artifact(art.name, art.type)
    plans = plan_chains(cfg, built, decoders, questions, tokenizer, eos_of(target, tokenizer)) if ecfg.plan.enabled else {}
    records = decode_questions(decoders, questions, tokenizer, ecfg.max_new_tokens, ecfg.warmup_tokens)
    t33 = ecfg.theorem_3_3
    sampled = decode_sampled({n: decoders[n] for n in built}, questions[: int(t33.questions)], tokenizer,
                             ecfg.max_new_tokens, float(t33.temperature), int(t33.seed)) if t33.questions else {}
    chains = {name: [level.name for level in chain.levels] for name, chain in built.items()}
    chains |= {plan["chain"]: chains[name] for name, plan in plans.items()}
    return conclude(cfg, records, chains, lambda ids: top2_margin(target, ids), weights_hash(target), tracker,
                    questions=len(questions), plans=plans, sampled=sampled)


def conclude(
    cfg: DictConfig, records: dict[str, list[Record]], chains: dict[str, list[str]],
    margin_fn: Callable[[list[int]], tuple[float, list[int]]], target_hash: str, tracker, questions: int,
    plans: dict[str, dict[str, Any]] | None = None, sampled: dict[str, list[Record]] | None = None,
) -> int:
    """From decoded records to the gate: evaluate, write the report, publish or refuse; the exit code."""
    from decode.report import write_report

    ecfg = cfg.eval
    near_tie = ecfg.checks.near_tie_relative.get(cfg.model.dtype)
    if near_tie is None:
        raise EvalError(f"eval.checks.near_tie_relative has no tolerance for dtype {cfg.model.dtype!r}")
    checks_cfg = OmegaConf.create({**OmegaConf.to_container(ecfg.checks), "near_tie_relative": near_tie})
    removed = clean_stale([ecfg.out_dir, ecfg.publish.dir])
    report = evaluate(records, chains, margin_fn, checks_cfg, plans=plans, sampled=sampled)
    speedups = {n: r["time_speedup"] for n, r in report["chains"].items()}
    decision = gate(report["checks"], speedups, str(ecfg.publish.chain), bool(ecfg.publish.force))
    report |= {"run_name": cfg.run_name, "gate": decision, "config": OmegaConf.to_container(ecfg, resolve=True),
               "questions": questions, "max_new_tokens": ecfg.max_new_tokens}
    out = write_report(report, ecfg.out_dir)
    tracker.summary({
        **{f"{n}/speedup": r["measured_speedup"] for n, r in report["chains"].items()},
        **{f"{n}/time_speedup": r["time_speedup"] for n, r in report["chains"].items()},
        **{f"{n}/{k}/predicted_speedup": p.get("speedup") for n, r in report["chains"].items() for k, p in r["predictions"].items()},
        **{f"{n}/{k}/prediction_error": p.get("error") for n, r in report["chains"].items() for k, p in r["predictions"].items()},
        **{f"{n}/L_{i + 1}": l["L_mean"] for n in chains for i, l in enumerate(report["summaries"][n]["levels"][:-1])},
        **{f"{n}/T_{i + 1}_ms": (l["T_s"] or 0) * 1e3 for n in chains for i, l in enumerate(report["summaries"][n]["levels"])},
        **{f"{n}/{cat}/speedup": row[n]["speedup"] for cat, row in report["categories"].items() for n in chains},
        **{f"check/{c['name']}": c["passed"] for c in report["checks"]},
        "published": decision["publish"], "published_chain": decision["chain"] or "", "forced": decision["forced"],
    })
    tracker.log_artifact(out, name=f"eval-{cfg.run_name}", type="eval-report")
    print((out / "report.md").read_text())  # the summary a pipeline run ends with
    for line in decision["failures"]:
        print(line, file=sys.stderr)
    for path in removed:
        print(f"removed a stale temp folder of an interrupted run: {path}")
    print(f"report: {out / 'report.md'}")
    if decision["publish"]:
        name = decision["chain"]
        levels = next((p["levels"] for p in report["plans"].values() if p["chain"] == name), None)
        manifest, folders = chain_manifest(cfg, name, levels or OmegaConf.to_container(ecfg.chains[name], resolve=True),
                                           target_hash, report, decision)
        bundle = publish_bundle(ecfg.publish.dir, manifest, out, folders)
        tracker.log_artifact(bundle, name=f"chain-{cfg.run_name}", type="chain", metadata=manifest)
        print(f"published {name}{' (FORCED despite failed checks)' if decision['forced'] else ''}: {bundle}")
    else:
        print(f"not published: {decision['explanation']} ({len(decision['failures'])} failed check(s))")
        stale = set_aside(ecfg.publish.dir)
        if stale is not None:
            print(f"moved the previously published bundle aside to {stale}: this eval does not admit it")
    tracker.finish(out / "metrics.json")
    return 0 if decision["publish"] else EXIT_NOT_PUBLISHED


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_main(run, cfg)


if __name__ == "__main__":
    main()
