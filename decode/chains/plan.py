"""The planner: each middle level's mu and the drafter's draft length or tree size, chosen to minimise
the refined prediction (decode.engine.theory.refined_time) of a chain's decoding time.

Calibration: a short greedy decode of held-out prompts, every middle level at the largest mu tried and
the drafter at its longest draft (a shorter chain draft is a prefix of a longer one, so one decode
serves every length) or at each tree shape (a tree of another depth or size is built differently, so
each shape is decoded). The chains planned together decode prompt by prompt, interleaved, so that a shared host's
load, which changes from one second to the next, falls on each chain's calibration alike. From it:
  accepted  per verifying level, the distribution of the tokens C it accepts of what the level below
            proposes; a proposal of m tokens (the first m of the longer one) is accepted min(C, m);
  costs     per verifying level a cost curve {tokens fed: seconds per forward} (decode.costs' costs.json
            when it times the level as it runs, its LM head included, else timed here with infra.timing),
            scaled so that it reproduces the calibration's forwards of the same sizes; the drafter's measured
            cost per forward and forwards per round at each shape;
  prefill   each lower level's first forward in a decode, its reading of the prompt (the target's is the first
            token, outside decoding time): seconds once a turn, so a token of a turn of T tokens carries 1 / T of
            it; kept out of the drafter's cost per forward and its forwards per round;
  overhead  the engine's own seconds beside every forward, per round of the level that spends them: each upper
            verifying level's own work (acceptance, cache crops) per its round, and per round of the last
            verifying level its own, the drafter's and the engine loop's, from each draft shape's own decodes
            (a deeper tree costs more to build and verify): a prediction of forwards alone is optimistic by that
            much, and one pooled number would charge a small tree the big trees' work and a level at mu 1 the
            rounds of mu 8.
A configuration is then predicted without decoding (engine.planner), and the plan is a new spec.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from decode.engine.chain import Chain
from decode.engine.levels import GenerationStats, LevelStats, ModelLevel
from decode.engine.planner import ChainModel, Dist, Shape, best, capped, mean, predict
from decode.engine.spec import ChainSpec
from decode.engine.theory import forward_cost, refined_time

if TYPE_CHECKING:
    from decode.settings import PlanSettings

Build = Callable[[ChainSpec], Chain]  # a spec's chain on already-loaded models (decode.chains.build.ChainBuilder.build)


def _accepted(stats: list[GenerationStats], i: int) -> Dist:
    counts = [x - 1 for s in stats for x in s.levels[i].acceptance_lengths]
    return {c: counts.count(c) / len(counts) for c in sorted(set(counts))} if counts else {0: 1.0}


def _drafts(level: LevelStats) -> tuple[int, float]:
    """(forwards, seconds) a drafting level spent after its prefill (a model-free drafter reads no prompt)."""
    if not level.forwards:
        return level.forward_calls, level.draft_time_s
    return level.forward_calls - 1, level.draft_time_s - level.forwards[0][1]


def _rounds(stats: list[GenerationStats], i: int) -> int:
    return sum(len(s.levels[i].acceptance_lengths) for s in stats)


def _per_round(stats: list[GenerationStats], i: int, value: str) -> float:
    """Level i+1's forwards after its prefill ('beta') or proposed tokens ('size') per verification round of level i."""
    rounds = _rounds(stats, i)
    total = sum(_drafts(s.levels[i + 1])[0] if value == "beta" else s.levels[i].proposed for s in stats)
    return total / rounds if rounds else 0.0


def _prefill(stats: list[GenerationStats]) -> float:
    """Seconds a decode spends on the levels below the target reading the prompt: each one's first forward."""
    firsts = [level.forwards[0][1] for s in stats for level in s.levels[1:] if level.forwards]
    return sum(firsts) / len(stats) if stats else 0.0


def _draft_cost(stats: list[GenerationStats]) -> float:
    """The drafter's seconds per forward after its prefill."""
    calls, seconds = map(sum, zip(*(_drafts(s.levels[-1]) for s in stats))) if stats else (0, 0.0)
    return seconds / max(calls, 1)


def _upper_overheads(stats: list[GenerationStats], last: int) -> tuple[float, ...]:
    """Per verifying level above the last one, its own seconds beside forwards per round it verifies."""
    return tuple(sum(s.levels[i].bookkeeping_time_s for s in stats) / max(_rounds(stats, i), 1) for i in range(last))


def _overhead(stats: list[GenerationStats], last: int) -> float:
    """Seconds per round of the last verifying level that the decodes spent beside every level's forwards, less
    what the levels above it spent on their own rounds."""
    upper = sum(s.levels[i].bookkeeping_time_s for s in stats for i in range(last))
    beside = sum(s.beside_forwards_s for s in stats) - upper
    rounds = _rounds(stats, last)
    return max(beside, 0.0) / rounds if rounds else 0.0


def _setting_name(draft: dict[str, Any]) -> str:
    return (f"depth {draft['depth']}, {draft['total_tokens']} tokens" if draft["mode"] == "tree"
            else f"length {draft['length']}")


def cost_curves(chain: Chain, rows: list[str | None], context: list[int],
                plan: PlanSettings) -> tuple[list[dict[int, float]], list[str]]:
    """Seconds per forward at k tokens for every verifying level: its costs.json row (`rows`: LevelSpec.cost_row, the
    level as it runs, its LM head included) where that was timed at every k of `plan.ks`, else timed here: the curve
    is read linearly between its points, and a row timed at fewer widths would be read across those where the
    products change tiles."""
    from infra.timing import level_forward, median_ms

    stored = json.loads(plan.costs.read_text())["ms"] if plan.costs and plan.costs.is_file() else {}
    stored = {row: ms for row, ms in stored.items() if {str(k) for k in plan.ks} <= set(ms)}
    verifiers: list[ModelLevel] = chain.levels[:-1]
    keys = [row if row in stored else f"{level.name} (timed)" for level, row in zip(verifiers, rows)]
    timed = {key: level_forward(level, context) for level, key in zip(verifiers, keys) if key not in stored}
    ms = stored | (median_ms(timed, list(plan.ks), plan.repeats) if timed else {})
    curves = [{int(k): v / 1e3 for k, v in ms[key].items()} for key in keys]
    return curves, [f"costs.json {key}" if key in stored else "timed" for key in keys]


@dataclass
class Calibration:
    """One chain's calibration: its settings (a variant of the spec each, `lengths` the chain drafts they stand
    for), its verifying levels' cost curves, and each setting's decodes as `decode_interleaved` adds them."""

    spec: ChainSpec
    chain: Chain  # the spec's own chain (its levels' names; the curves were timed on it)
    settings: list[dict[str, Any]]
    lengths: list[int]
    mu: int
    variants: list[Chain]
    curves: tuple[list[dict[int, float]], list[str]]  # seconds per forward at k tokens, and where each came from
    runs: list[list[GenerationStats]] = field(init=False)  # per setting, its decodes
    seconds: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        self.runs = [[] for _ in self.settings]


def prepare(spec: ChainSpec, build: Build, prompts: list[list[int]], plan: PlanSettings) -> Calibration:
    """A chain's calibration before decoding: every middle level at the largest mu, the drafter at its longest chain
    draft or at each tree shape, each a variant of `spec`."""
    configured = spec.knobs()
    draft = configured["draft"]
    mu_max = max(list(plan.mu) + list(configured["mu"].values()))
    if draft["mode"] == "tree":
        trees, lengths = [{**draft, **t} for t in plan.trees], []
        settings = trees + ([draft] if draft not in trees else [])
    else:
        lengths = sorted(set(plan.lengths) | {int(draft["length"])})
        settings = [{**draft, "length": lengths[-1]}]
    context = [t for p in prompts for t in p][: plan.context]
    chain = build(spec)
    curves = cost_curves(chain, [level.cost_row for level in spec.levels[:-1]], context, plan)
    variants = [build(spec.with_knobs({"mu": {name: mu_max for name in configured["mu"]}, "draft": setting}))
                for setting in settings]
    return Calibration(spec, chain, settings, lengths, mu_max, variants, curves)


def decode_interleaved(calibrations: list[Calibration], prompts: list[list[int]], max_new_tokens: int,
                       eos: Any) -> None:
    """Every calibration's settings decode one prompt, then the next: load on a shared host changes from one second to
    the next, and this way it falls on every chain's calibration alike (as the eval interleaves its methods)."""
    for prompt in prompts:
        for cal in calibrations:
            for variant, runs in zip(cal.variants, cal.runs):
                start = time.perf_counter()
                runs.append(variant.generate(prompt, max_new_tokens, eos_token_id=eos).stats)
                cal.seconds += time.perf_counter() - start


def _steady(stats: list[GenerationStats], i: int) -> list[tuple[int, float]]:
    """Level i's (tokens fed, seconds) forwards after its prefill: a lower level's first forward reads the prompt (the
    target's prefill is not among its forwards)."""
    return [f for s in stats for f in (s.levels[i].forwards[1:] if i else s.levels[i].forwards)]


def _scaled(curves: list[dict[int, float]], pooled: list[GenerationStats]) -> list[float]:
    """Per verifying level, its in-chain seconds over its curve's for the same forwards (`_steady`: a prompt's
    prefill is outside the curve)."""
    scales = []
    for i, curve in enumerate(curves):
        inside = [(k, t) for k, t in _steady(pooled, i) if k <= max(curve)]
        scales.append(sum(t for _, t in inside) / sum(forward_cost(curve, k) for k, _ in inside) if inside else 1.0)
    return scales


def model_of(cal: Calibration, prompts: int, max_new_tokens: int, turn_tokens: int) -> tuple[ChainModel, dict]:
    """The model of a decoded calibration's chain for turns of `turn_tokens` decoded tokens, and what was measured."""
    n, pooled = len(cal.chain.levels), [s for run in cal.runs for s in run]
    curves, sources = cal.curves
    scales = _scaled(curves, pooled)
    curves = [{k: v * scale for k, v in curve.items()} for curve, scale in zip(curves, scales)]
    shapes, by_setting = [], {}
    for setting, stats in zip(cal.settings, cal.runs):
        cost = _draft_cost(stats)
        beta, size = _per_round(stats, n - 2, "beta"), _per_round(stats, n - 2, "size")
        accepted, overhead = _accepted(stats, n - 2), _overhead(stats, n - 2)
        by_setting[_setting_name(setting)] = 1e3 * overhead
        if setting["mode"] == "tree":
            shapes.append(Shape(setting, accepted, size, beta, cost, overhead))
        else:
            shapes += [Shape({**setting, "length": k}, capped(accepted, {k: 1.0}), min(size, k), min(beta, k), cost,
                             overhead) for k in cal.lengths]
    upper, prefill = _upper_overheads(pooled, n - 2), _prefill(pooled)
    model = ChainModel(curves, [_accepted(pooled, i) for i in range(n - 2)], shapes, upper,
                       prefill / max(turn_tokens, 1))
    measured = {
        "prompts": prompts, "max_new_tokens": max_new_tokens, "decodes": len(cal.settings) * prompts,
        "mu": cal.mu, "seconds": cal.seconds, "prefill_ms": 1e3 * prefill, "turn_tokens": turn_tokens,
        "overhead_ms": {"upper levels": [1e3 * o for o in upper], "last verifier": by_setting},
        "costs": {level.name: {"source": src, "scale": scale, "ms": {k: 1e3 * v for k, v in curve.items()}}
                  for level, src, scale, curve in zip(cal.chain.levels, sources, scales, curves)},
    }
    return model, measured


def at_measured_acceptance(predicted: dict[str, Any], calibration: dict[str, Any],
                           stats: list[GenerationStats]) -> float:
    """Seconds per decoded token by a plan's costs (its verifying levels' cost curves, the drafter's cost per forward,
    the overheads a round and the prompt reading it calibrated) on what `stats`' decodes measured: each level's
    acceptance, hand-ups and draft forwards per round, the tokens each forward carried, the turns and their tokens.
    Against the measured time its error is the cost model's and the host's load since the calibration; the rest of a
    plan's error is acceptance (the calibration prompts are not the eval's)."""
    n = len(stats[0].levels)
    costs = []
    for i, level in enumerate(calibration["costs"].values()):  # the verifying levels', target first
        curve = {int(k): v / 1e3 for k, v in level["ms"].items()}
        carried = [k for k, _ in _steady(stats, i)]
        costs.append(statistics.fmean(forward_cost(curve, k) for k in carried) if carried else forward_cost(curve, 1))
    lengths = [1 + mean(_accepted(stats, i)) for i in range(n - 1)]
    handed_up = [_per_round(stats, i, "size") for i in range(n - 2)]
    seconds = refined_time(lengths, handed_up, _per_round(stats, n - 2, "beta"), 1,
                           costs + predicted["costs_s"][-1:], predicted["overheads_s"])
    tokens = sum(max(s.new_tokens - 1, 0) for s in stats)
    return seconds + len(stats) * calibration["prefill_ms"] / 1e3 / max(tokens, 1)


def plan_chains(specs: dict[str, ChainSpec], build: Build, prompts: list[list[int]], plan: PlanSettings, eos: Any,
                turn_tokens: int) -> dict[str, dict[str, Any]]:
    """Calibrate every chain of `specs` on `prompts`, interleaved (`decode_interleaved`), then per chain the planned
    knobs next to the configured ones, each with its predicted time per token of turns of `turn_tokens` decoded tokens
    and its predicted speedup over AR (the target's 1-token forward, from the same curve)."""
    calibrations = {name: prepare(spec, build, prompts, plan) for name, spec in specs.items()}
    decode_interleaved(list(calibrations.values()), prompts, plan.max_new_tokens, eos)
    return {name: _plan(cal, model_of(cal, len(prompts), plan.max_new_tokens, turn_tokens), plan)
            for name, cal in calibrations.items()}


def _plan(cal: Calibration, modelled: tuple[ChainModel, dict[str, Any]], plan: PlanSettings) -> dict[str, Any]:
    """A plan predicted less than `plan.min_gain` faster keeps the configured values: the calibration is short and
    noisy."""
    (model, calibration), configured = modelled, cal.spec.knobs()
    mine = predict(model, list(configured["mu"].values()),
                   next(s for s in model.shapes if s.draft == configured["draft"]))
    mus, shape, predicted = best(model, list(plan.mu))
    planned = {"mu": dict(zip(configured["mu"], mus)), "draft": shape.draft}
    if predicted["s_per_token"] > (1 - plan.min_gain) * mine["s_per_token"]:
        planned, predicted = configured, mine
    ar = forward_cost(model.curves[0], 1)
    return {
        "configured": {"knobs": configured, "predicted": mine | {"speedup": ar / mine["s_per_token"]}},
        "planned": {"knobs": planned, "predicted": predicted | {"speedup": ar / predicted["s_per_token"]}},
        "candidates": len(model.shapes) * len(plan.mu) ** (len(cal.spec.levels) - 2),
        "calibration": calibration,
    }
