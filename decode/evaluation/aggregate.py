"""From per-turn records to what the report says per method and category: pooled times and acceptance per level,
Spec-Bench and time speedups with their paired intervals (decode.evaluation.speedup), Theorem 3.1 and refined
predictions."""
from __future__ import annotations

import statistics
from typing import Any

from decode.evaluation import measure
from decode.evaluation import speedup as paired
from decode.evaluation.decoding import Record


def summarize(records: list[Record]) -> dict[str, Any]:
    """decode.evaluation.measure's pooled per-level numbers and both predictions, over these turns."""
    return measure.summarize([r.stats for r in records])


def theory_inputs(summary: dict[str, Any]) -> tuple[list, list, Any]:
    """(forward_times, acceptance, draft_depth) for decode.theory from a chain's summary."""
    levels = summary["levels"]
    return [level["T_s"] for level in levels], [level["L_mean"] for level in levels[:-1]], summary["draft_depth"]


def speedup(records: list[Record], reference: list[Record]) -> float:
    """Spec-Bench's speedup: mean tokens/s over questions, over the reference's mean tokens/s."""
    return statistics.fmean(r.tokens_per_s for r in records) / statistics.fmean(r.tokens_per_s for r in reference)


def time_ratio(summary: dict[str, Any], reference: dict[str, Any]) -> float:
    """The time speedup as one number (decode.evaluation.speedup.time_speedup gives it with its interval): seconds
    per token of the reference over the chain's, pooled over all turns (prefill included: what a user waits), and
    robust to load that changes during the run since methods are interleaved."""
    return (reference["wall_time_s"] / reference["new_tokens"]) / (summary["wall_time_s"] / summary["new_tokens"])


def speedup_interval(records: list[Record], reference: list[Record], confidence: float) -> dict[str, Any]:
    """The pooled time speedup over the same turns of the reference, with its paired interval
    (decode.evaluation.speedup)."""
    def timed(recs: list[Record]) -> list[tuple[float, int]]:
        return [(r.stats.wall_time_s, r.stats.new_tokens) for r in recs]

    return paired.time_speedup(timed(reference), timed(records), confidence).as_dict()


def error_intervals(result: dict[str, Any], rows: list[dict[str, Any]], confidence: float) -> None:
    """Each prediction's error gets an interval: the turns' spread of predicted over measured decoding time
    (a paired ratio, decode.evaluation.speedup), around the pooled prediction's error."""
    for name, p in result["predictions"].items():
        turns = [(r["predicted_time_s"][name], r["decode_time_s"]) for r in rows
                 if r["predicted_time_s"].get(name) is not None and r["decode_time_s"] > 0]
        if p.get("error") is None or not turns:
            continue
        spread = paired.ratio(*zip(*turns), confidence=confidence)
        if spread.low is not None:
            p["error_interval"] = [(1 + p["error"]) * b / spread.estimate - 1 for b in (spread.low, spread.high)]


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
        "levels": [{k: level[k] for k in ("name", "forward_calls", "T_s", "L_mean", "L_var")}
                   | {"acceptance_lengths": list(raw.acceptance_lengths)}
                   for level, raw in zip(summary["levels"], record.stats.levels)],
    }


def by_category(records: dict[str, list[Record]], confidence: float,
                reference: str = "ar") -> dict[str, dict[str, Any]]:
    table: dict[str, dict[str, Any]] = {}
    for category in dict.fromkeys(r.category for r in records[reference]):
        ref = [r for r in records[reference] if r.category == category]
        row = {}
        for name, recs in records.items():
            mine = [r for r in recs if r.category == category]
            summary = summarize(mine)
            row[name] = {
                "tokens_per_s": summary["tokens_per_s"], "speedup": speedup(mine, ref),
                "time_speedup_interval": speedup_interval(mine, ref, confidence),
                "T_s": [level["T_s"] for level in summary["levels"]],
                "L": [level["L_mean"] for level in summary["levels"][:-1]],
                "L_var": [level["L_var"] for level in summary["levels"][:-1]],
            }
        table[category] = row
    return table
