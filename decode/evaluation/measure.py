"""What a chain's generations measured, per level, and the two predictions of its decoding time.

One place for decode.bench and decode.eval, so both print the same numbers for the same generations.
Times are decoding times after the first token (the engine's per-level stats exclude the prefill, whose
time is time_to_first_token_s); N is the tokens decoded after the first, pooled over generations.
  paper    Theorem 3.1 on the pooled T_i, L_i and beta (decode.theory.predicted_time);
  refined  each level's rounds counted from the tokens it hands up, at its measured cost per forward
           (decode.theory.refined_time). On measured values its rounds equal the levels' forward calls
           (the tokens a level hands up are the sum of its acceptance lengths), so its error is the time
           spent outside forwards; the planner's prediction (decode.chains.plan) is the same formula fed from a
           model of the chain instead, and is checked against the planned chain's measurement.
"""
from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any, Sequence

from decode.engine.theory import TheoryError, predicted_time, refined_time

if TYPE_CHECKING:
    from decode.engine.levels import GenerationStats


def summarize(stats: Sequence[GenerationStats]) -> dict[str, Any]:
    """Pooled per-level numbers of a method's generations, and both predictions against the measured time."""
    levels = []
    for i, first in enumerate(stats[0].levels):
        per = [s.levels[i] for s in stats]
        calls = sum(stat.forward_calls for stat in per)
        lengths = [x for stat in per for x in stat.acceptance_lengths]
        carried = [k for stat in per for k, _ in stat.forwards]
        levels.append({
            "name": first.name, "kind": first.kind, "runner": first.runner, "forward_calls": calls,
            "T_s": sum(stat.draft_time_s + stat.verify_time_s for stat in per) / calls if calls else None,
            "L_mean": statistics.fmean(lengths) if lengths else None,
            "L_var": statistics.variance(lengths) if len(lengths) > 1 else None,
            "verifications": len(lengths), "L_histogram": dict(sorted(_count(lengths).items())),
            "proposed": sum(stat.proposed for stat in per), "accepted": sum(stat.accepted for stat in per),
            "tokens_per_forward": statistics.fmean(carried) if carried else None,
            "bookkeeping_s": sum(stat.bookkeeping_time_s for stat in per),
        })
    for above, level in zip(levels, levels[1:-1]):  # P_i: what a middle level hands up per round above it
        level["handed_up"] = above["proposed"] / above["verifications"] if above["verifications"] else None
    rounds = levels[-2]["verifications"] if len(levels) > 1 else 0
    summary = {
        "levels": levels,
        "draft_depth": levels[-1]["forward_calls"] / rounds if rounds else None,
        "new_tokens": sum(s.new_tokens for s in stats),
        "decode_tokens": sum(max(s.new_tokens - 1, 0) for s in stats),
        "wall_time_s": sum(s.wall_time_s for s in stats),
        "decode_time_s": sum(s.wall_time_s - s.time_to_first_token_s for s in stats),
        "tokens_per_s": statistics.fmean(s.tokens_per_s for s in stats),
    }
    summary["predictions"] = predictions(summary)
    return summary


def _count(values: list[int]) -> dict[int, int]:
    hist: dict[int, int] = {}
    for x in values:
        hist[x] = hist.get(x, 0) + 1
    return hist


def predictions(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{"paper": ..., "refined": ...}: each the predicted decoding time and its error against the measured
    one, or the reason it cannot be evaluated (a level never measured, too few tokens)."""
    levels, n = summary["levels"], summary["decode_tokens"]
    times, lengths = [level["T_s"] for level in levels], [level["L_mean"] for level in levels[:-1]]
    inputs = {
        "paper": lambda: predicted_time(times, lengths, summary["draft_depth"] or 0, n),
        "refined": lambda: refined_time(lengths, [level["handed_up"] for level in levels[1:-1]],
                                        summary["draft_depth"] or 0, n, times),
    }
    out = {}
    for name, predict in inputs.items():
        try:
            predicted = predict()
        except TheoryError as err:
            out[name] = {"error_reason": str(err)}
            continue
        measured = summary["decode_time_s"]
        out[name] = {"time_s": predicted, "error": predicted / measured - 1 if measured > 0 else None}
    return out


def level_line(summary: dict[str, Any]) -> str:
    """Per level: what ran it, mean forward time, acceptance length and (middle levels) tokens handed up per round."""
    return ", ".join(_level(level) for level in summary["levels"])


def _level(level: dict[str, Any]) -> str:
    runner = f" ({level['runner']})" if level.get("runner") else ""
    text = f"{level['name']}{runner}: T=" + ("n/a" if level["T_s"] is None else f"{1e3 * level['T_s']:.0f}ms")
    if level["L_mean"] is not None:
        text += f" L={level['L_mean']:.2f}"
    if level.get("handed_up") is not None:
        text += f" P={level['handed_up']:.2f}"
    return text


def prediction_line(summary: dict[str, Any]) -> str:
    """Both predictions next to the measured decoding time, each with its error."""
    parts = []
    for name, label in (("paper", "Thm 3.1"), ("refined", "refined")):
        p = summary["predictions"][name]
        parts.append(f"{label} {p['time_s']:.1f}s ({100 * p['error']:+.0f}%)" if p.get("error") is not None
                     else f"{label} n/a")
    return " | ".join(parts) + f" vs {summary['decode_time_s']:.1f}s measured"
