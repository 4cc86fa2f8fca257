"""The eval's checks, each a named pass/fail with one line per failure: lossless (greedy outputs equal AR but at a
near-tie), insertion (Theorem 3.2 on measured T and L), agreement (predictions against measured times), and
Theorem 3.3's variance comparison; `evaluate_chains` computes the whole report from the decoded records."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable

from decode.chains.plan import at_measured_acceptance
from decode.evaluation import speedup as paired
from decode.evaluation import EvalError
from decode.engine.theory import InsertionCase, TheoryError, insertion_conditions, insertion_improves
from decode.evaluation.aggregate import (by_category, chain_result, error_intervals, record_row, speedup,
                                         speedup_interval, summarize, theory_inputs, time_ratio)
from decode.evaluation.decoding import Decoded, Record

if TYPE_CHECKING:
    from decode.settings import CheckSettings

PREDICTIONS = {"refined": "the refined prediction", "paper": "Theorem 3.1"}


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
        return {"name": self.name, "passed": self.passed, "reasons": self.reasons, "by_chain": self.by_chain,
                "details": self.details}


# (prompt, forced tokens, n) -> AR's greedy tokens after the prompt, the forced ones first, and each position's
# (relative top-2 margin, top-2 tokens) from the forward that chose it (decode.chains.baselines.greedy_margins)
ReferenceFn = Callable[[list[int], list[int], int], tuple[list[int], list[tuple[float, list[int]]]]]


def compare_greedy(prompt: list[int], mine: list[int], ref: list[int], reference_fn: ReferenceFn,
                   near_tie: float) -> tuple[str | None, list[dict[str, Any]]]:
    """`mine` against AR's `ref`, token for token; the first unexcused difference (None: none) and the ties.

    At a divergence the target's top-2 margin is the one AR's own forward saw there. A near-tie between exactly
    those two tokens is excused and the comparison goes on: AR is re-decoded from the tied prefix with `mine`'s
    token and the rest compared, so a later divergence (a cache bug often shows first as a tie) still fails."""
    ties: list[dict[str, Any]] = []
    start, budget = 0, max(len(mine), len(ref))
    while True:
        pos = next((i for i in range(start, min(len(mine), len(ref))) if mine[i] != ref[i]), None)
        if pos is None:
            return (None if len(mine) == len(ref) else f"{len(mine)} tokens instead of {len(ref)}"), ties
        margin, top2 = reference_fn(prompt, ref[:pos], pos + 1)[1][pos]
        if margin > near_tie:
            return (f"token {pos} is {mine[pos]}, AR has {ref[pos]} (target top-2 margin {margin:.2e} > "
                    f"near-tie tolerance {near_tie:.0e})"), ties
        if not {mine[pos], ref[pos]} <= set(top2):
            return f"token {pos} is {mine[pos]}, AR has {ref[pos]}, not the target's top-2 {top2}", ties
        ties.append({"position": pos, "margin": margin})
        ref, start = reference_fn(prompt, mine[: pos + 1], budget)[0], pos + 1


def check_lossless(records: dict[str, list[Record]], reference_fn: ReferenceFn, near_tie: float,
                   reference: str = "ar") -> Check:
    """Token-for-token equality with the reference; a divergence at a near-tie is counted, not failed, and the
    turn is compared on past it (`compare_greedy`)."""
    check, ties, compared = Check("lossless"), [], 0
    for name, recs in records.items():
        if name == reference:
            continue
        for mine, ref in zip(recs, records[reference]):
            compared += 1
            if mine.tokens == ref.tokens:
                continue
            reason, found = compare_greedy(ref.prompt_ids, mine.tokens, ref.tokens, reference_fn, near_tie)
            ties += [{"chain": name, "question_id": ref.question_id, "turn": ref.turn, **t} for t in found]
            if reason is not None:
                check.fail(name, f"{name}: question {ref.question_id} turn {ref.turn + 1}: {reason}")
    check.details = {"compared_turns": compared, "near_ties": ties, "near_tie_tolerance": near_tie,
                     "near_ties_excused": len(ties), "after_a_tie": "compared against AR re-decoded from the tie"}
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
        closed = insertion_conditions(InsertionCase(
            values["T_i"], values["L_i_new"], values["T_new"], values["L_new"], values["T_next"], values["L_i"],
            draft_depth=values["beta"], l_new_next=values["L_new"]))
        direct = insertion_improves(theory_inputs(wo), theory_inputs(w))
    except TheoryError as err:
        return {**ins, "values": values, "error": str(err), "improves": False}
    verdict = {"theorem": closed.improves, "direct": direct.improves, "both": closed.improves and direct.improves}[rule]
    return {**ins, "values": values, "theorem_3_2": closed.as_dict(), "direct": direct.as_dict(), "rule": rule,
            "improves": verdict}


def check_insertion(insertions: list[dict[str, Any]]) -> Check:
    check = Check("insertion", details={"insertions": len(insertions)})
    for ins in insertions:
        if ins.get("error"):
            check.fail(ins["with"], f"{ins['level']} in {ins['with']}: Theorem 3.2 cannot be evaluated "
                                    f"({ins['error']})")
        elif not ins["improves"]:
            t, d = ins["theorem_3_2"], ins["direct"]
            why = []
            if ins["rule"] in ("theorem", "both") and not t["improves"]:
                why.append("Theorem 3.2 fails both conditions "
                           f"(T_new/T_i {t['lhs_first']:.3f} >= {t['rhs_first']:.3f}, "
                           f"T_new/T_i+1 {t['lhs_second']:.3f} >= {t['rhs_second']:.3f})")
            if ins["rule"] in ("direct", "both") and not d["improves"]:
                why.append(f"Theorem 3.1 predicts {d['time_with'] * 1e3:.2f} ms/token with it vs "
                           f"{d['time_without'] * 1e3:.2f} ms without")
            check.fail(ins["with"], f"{ins['level']} between {ins['between'][0]} and {ins['between'][1]} does not pay "
                                    f"for itself: {'; '.join(why)}")
    return check


def check_agreement(
    chain_results: dict[str, dict[str, Any]], insertions: list[dict[str, Any]], tolerance: float,
    prediction: str = "refined",
) -> Check:
    """A prediction of each chain's decoding time (refined by default) against the measured one, and an
    insertion the theory admits measured faster. Each fails only where the measurement shows it: the error's
    interval lies wholly outside the tolerance, or the insertion's paired speedup interval lies below 1."""
    if prediction not in PREDICTIONS:
        raise EvalError(f"eval.checks.agreement_prediction must be one of {', '.join(PREDICTIONS)}, "
                        f"got {prediction!r}")
    check, label = (Check("agreement", details={"prediction": prediction, "tolerance": tolerance}),
                    PREDICTIONS[prediction])
    for name, res in chain_results.items():
        p = res["predictions"][prediction]
        if p.get("error") is None:
            check.fail(name, f"{name}: {label} cannot be evaluated "
                             f"({p.get('error_reason', 'no decoding time measured')})")
            continue
        bounds = p.get("error_interval")
        low, high = bounds or (p["error"], p["error"])  # no interval (one turn): the point itself
        if low > tolerance or high < -tolerance:
            spread = f" [{low:+.0%}, {high:+.0%}]" if bounds else ""
            check.fail(name, f"{name}: {label} predicts {p['time_s']:.2f}s of decoding, "
                             f"measured {res['decode_time_s']:.2f}s "
                             f"({p['error']:+.0%}{spread}, tolerance {tolerance:.0%})")
    for ins in insertions:
        gain = paired.Interval.from_dict(ins["measured_gain"])
        if ins["improves"] and gain.below_one:
            check.fail(ins["with"], f"{ins['with']}: the theory says inserting {ins['level']} is faster, "
                                    f"but it measured slower than {ins['without']}: {gain.verdict()}")
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
            row = {"level": g["name"],
                   **{side: {"L": level["L_mean"], "var": level["L_var"], "verifications": level["verifications"]}
                      for side, level in (("greedy", g), ("sampling", s))}}
            row["claim_holds"] = None if None in (g["L_var"], s["L_var"]) else s["L_var"] < g["L_var"]
            rows.append(row)
        out[name] = rows
    return out


def speedups(records: dict[str, list], summaries: dict[str, dict], name: str, reference: str,
             confidence: float) -> dict[str, Any]:
    """A decoded method's speedup over the reference: by tokens, by time, and its interval."""
    return {"measured_speedup": speedup(records[name], records[reference]),
            "time_speedup": time_ratio(summaries[name], summaries[reference]),
            "time_speedup_interval": speedup_interval(records[name], records[reference], confidence)}


def evaluate_each_chain(records: dict[str, list], summaries: dict[str, dict], rows: dict[str, list],
                        chains: Iterable[str], reference: str, confidence: float) -> dict[str, dict]:
    """Each chain's result: its summary against the reference's, its speedups, its predictions' error intervals."""
    results = {}
    for name in chains:
        results[name] = chain_result(summaries[name], summaries[reference]) | speedups(
            records, summaries, name, reference, confidence)
        error_intervals(results[name], rows[name], confidence)
    return results


def insertions_of(decoded: Decoded, summaries: dict[str, dict], results: dict[str, dict],
                  checks: CheckSettings) -> list[dict[str, Any]]:
    """Every level insertion among the decoded chains (configured chains and stacks paired with each other, planned
    chains with planned ones), judged by the insertion rule, with both sides' speedups and the measured gain."""
    chains, plans, records = decoded.names, decoded.plans, decoded.records
    planned = {plan["chain"] for base, plan in plans.items() if plan["chain"] != base}
    groups = [[n for n in chains if n not in planned], [p["chain"] for p in plans.values() if p["chain"] in chains]]
    pairs = {(i["with"], i["without"], i["index"]): i
             for g in groups for i in find_insertions({n: chains[n] for n in g})}
    insertions = [evaluate_insertion(ins, summaries, checks.insertion_rule) for ins in pairs.values()]
    for ins in insertions:
        ins["speedups"] = {side: {"predicted": results[ins[side]]["predictions"]["paper"].get("speedup"),
                                  "measured": results[ins[side]]["time_speedup"]} for side in ("without", "with")}
        ins["measured_gain"] = speedup_interval(records[ins["with"]], records[ins["without"]], checks.confidence)
    return insertions


def score_plans(decoded: Decoded, summaries: dict[str, dict], reference: str) -> dict[str, dict]:
    """The planner's predictions (decoded.plans) against what the chains it chose measured."""
    records, plans = decoded.records, decoded.plans
    per_token = {name: s["decode_time_s"] / max(s["decode_tokens"], 1) for name, s in summaries.items()}
    for base, plan in plans.items():
        for side in plan["decoded"]:
            name = base if side == "configured" else plan["chain"]
            costs_alone = at_measured_acceptance(plan[side]["predicted"], plan["calibration"],
                                                 [r.stats for r in records[name]])
            plan[side] |= {"measured_s_per_token": per_token[name],
                           "measured_speedup": per_token[reference] / per_token[name],
                           "error": plan[side]["predicted"]["s_per_token"] / per_token[name] - 1,
                           "measured_L": [level["L_mean"] for level in summaries[name]["levels"][:-1]],
                           "cost_error": costs_alone / per_token[name] - 1}
    return plans


def evaluate_chains(decoded: Decoded, reference_fn: ReferenceFn, checks: CheckSettings, near_tie: float,
                    reference: str = "ar") -> dict[str, Any]:
    """Everything the report holds, computed from the decoded records: summaries, theory, checks, plans.

    `decoded.plans` maps a configured chain or a searched stack to its plan (decode.chains.plan.plan_chains, plus
    "chain": the planned chain's name, "decoded": the sides decoded)."""
    records, confidence = decoded.records, checks.confidence
    summaries = {name: summarize(recs) for name, recs in records.items()}
    rows = {name: [record_row(r, ref) for r, ref in zip(recs, records[reference])] for name, recs in records.items()}
    results = evaluate_each_chain(records, summaries, rows, decoded.names, reference, confidence)
    baselines = {name: speedups(records, summaries, name, reference, confidence)  # e.g. ar_eager
                 for name in records if name != reference and name not in decoded.names}
    insertions = insertions_of(decoded, summaries, results, checks)
    verdicts = [
        check_lossless(records, reference_fn, near_tie, reference),
        check_insertion(insertions),
        check_agreement(results, insertions, checks.agreement_tolerance, checks.agreement_prediction),
    ]
    return {
        "summaries": summaries, "chains": results, "baselines": baselines, "insertions": insertions,
        "plans": score_plans(decoded, summaries, reference),
        "theorem_3_3": theorem_3_3(records, decoded.sampled),
        "categories": by_category(records, confidence, reference), "checks": [c.as_dict() for c in verdicts],
        "records": rows,
    }
