"""The planner: each middle level's mu and the drafter's draft length or tree size, chosen to minimise
the refined prediction (decode.theory.refined_time) of a chain's decoding time.

Calibration: a short greedy decode of held-out prompts, every middle level at the largest mu tried and
the drafter at its longest draft (a shorter chain draft is a prefix of a longer one, so one decode
serves every length) or at each tree shape (a tree of another depth or size is built differently, so
each shape is decoded). From it:
  accepted  per verifying level, the distribution of the tokens C it accepts of what the level below
            proposes; a proposal of m tokens (the first m of the longer one) is accepted min(C, m);
  costs     per verifying level a cost curve {tokens fed: seconds per forward} (decode.costs' costs.json
            when it names the level, else timed here with data.timing), scaled so that it reproduces
            the calibration's forwards of the same sizes; the drafter's measured cost per forward and
            forwards per round at each shape.
A configuration is then predicted without decoding: the last verifying level gains A + 1 tokens a
round; a middle level hands up its pending buffer when it first holds >= mu tokens (first passage);
the level above accepts min(C, buffer) of it and feeds buffer + 1 tokens a forward.
"""
from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from decode.engine.chain import Chain

from decode.engine.levels import GenerationStats, ModelLevel
from decode.engine.theory import forward_cost, refined_time

Dist = dict[int, float]  # value -> probability


@dataclass(frozen=True)
class Shape:
    """One drafter configuration and what the calibration says about it."""

    draft: dict[str, Any]  # the drafter's draft config
    accepted: Dist  # tokens the last verifying level accepts of one proposal
    size: float  # tokens proposed per round
    beta: float  # drafter forwards per round
    cost: float  # drafter seconds per forward


@dataclass(frozen=True)
class ChainModel:
    curves: list[dict[int, float]]  # per verifying level (target first): seconds per forward at k tokens fed
    accepted: list[Dist]  # per verifying level but the last: tokens accepted of what the level below hands up
    shapes: list[Shape]


# ------------------------------------------------------------------------------------- the model (pure)


def mean(dist: Dist) -> float:
    return sum(v * p for v, p in dist.items())


def shift(dist: Dist, by: int) -> Dist:
    return {v + by: p for v, p in dist.items()}


def capped(accepted: Dist, size: Dist) -> Dist:
    """Distribution of min(C, H) for independent C ~ accepted and H ~ size."""
    out: Dist = {}
    for c, p in accepted.items():
        for h, q in size.items():
            out[min(c, h)] = out.get(min(c, h), 0.0) + p * q
    return out


def first_passage(gain: Dist, mu: int) -> Dist:
    """Size of a pending buffer that grows by `gain` tokens a round and is handed up once it holds >= mu."""
    below, out = {0: 1.0}, {}
    for s in range(mu):  # gains are >= 1, so states below mu are visited in increasing order
        p = below.pop(s, 0.0)
        for g, q in gain.items() if p else ():
            target = out if s + g >= mu else below
            target[s + g] = target.get(s + g, 0.0) + p * q
    return out


def predict(model: ChainModel, mus: Sequence[int], shape: Shape) -> dict[str, Any]:
    """The refined prediction of seconds per decoded token for middle-level mus and a drafter shape."""
    n = len(model.curves)
    gain, fed = shift(shape.accepted, 1), {1 + shape.size: 1.0}
    lengths, handed_up, costs = [0.0] * n, [0.0] * (n - 1), [0.0] * n
    for i in reversed(range(n)):
        lengths[i] = mean(gain)
        costs[i] = sum(p * forward_cost(model.curves[i], k) for k, p in fed.items())
        if i:
            buffer = first_passage(gain, mus[i - 1])
            handed_up[i - 1] = mean(buffer)
            gain, fed = shift(capped(model.accepted[i - 1], buffer), 1), shift(buffer, 1)
    seconds = refined_time(lengths, handed_up, shape.beta, 1, costs + [shape.cost])
    return {"s_per_token": seconds, "L": lengths, "P": handed_up, "beta": shape.beta, "costs_s": costs + [shape.cost]}


def best(model: ChainModel, mu_grid: Sequence[int]) -> tuple[tuple[int, ...], Shape, dict[str, Any]]:
    """The (mus, shape) with the least predicted time, over every mu of the grid for every middle level."""
    options = itertools.product(itertools.product(mu_grid, repeat=len(model.curves) - 1), model.shapes)
    return min(((mus, shape, predict(model, mus, shape)) for mus, shape in options), key=lambda o: o[2]["s_per_token"])


# ------------------------------------------------------------------------------------------ calibration


def knobs(chain: Chain) -> dict[str, Any]:
    """What the planner sets: every middle level's mu and the drafter's draft config."""
    return {"mu": {level.name: level.mu for level in chain.levels[1:-1]}, "draft": dict(chain.levels[-1].draft_cfg)}


def apply(chain: Chain, values: dict[str, Any]) -> None:
    for level in chain.levels[1:-1]:
        level.mu = int(values["mu"][level.name])
    chain.levels[-1].draft_cfg = dict(values["draft"])


def _accepted(stats: list[GenerationStats], i: int) -> Dist:
    counts = [x - 1 for s in stats for x in s.levels[i].acceptance_lengths]
    return {c: counts.count(c) / len(counts) for c in sorted(set(counts))} if counts else {0: 1.0}


def _per_round(stats: list[GenerationStats], i: int, value: str) -> float:
    """Level i+1's forwards ('beta') or proposed tokens ('size') per verification round of level i."""
    rounds = sum(len(s.levels[i].acceptance_lengths) for s in stats)
    total = sum(s.levels[i + 1].forward_calls if value == "beta" else s.levels[i].proposed for s in stats)
    return total / rounds if rounds else 0.0


def cost_curves(chain: Chain, context: list[int], cfg: Any) -> tuple[list[dict[int, float]], list[str]]:
    """Seconds per forward at k tokens for every verifying level: costs.json's row of the same name, else timed."""
    from data.timing import cached_forward, median_ms

    stored = json.loads(Path(cfg.costs).read_text())["ms"] if cfg.get("costs") and Path(cfg.costs).is_file() else {}
    verifiers: list[ModelLevel] = chain.levels[:-1]
    timed = {l.name: cached_forward(l.model, context) for l in verifiers if l.name not in stored}
    ms = stored | (median_ms(timed, [int(k) for k in cfg.ks], int(cfg.repeats)) if timed else {})
    curves = [{int(k): v / 1e3 for k, v in ms[l.name].items()} for l in verifiers]
    return curves, ["costs.json" if l.name in stored else "timed" for l in verifiers]


def calibrate(chain: Chain, prompts: list[list[int]], cfg: Any, eos: Any) -> tuple[ChainModel, dict[str, Any]]:
    """Decode `prompts` at each calibration setting; the model of the chain, and what was measured."""
    configured = knobs(chain)
    draft = configured["draft"]
    mu_max = max([int(m) for m in cfg.mu] + list(configured["mu"].values()))
    if draft["mode"] == "tree":
        trees = [{**draft, **dict(t)} for t in cfg.trees]
        settings = trees + ([draft] if draft not in trees else [])
    else:
        lengths = sorted({int(k) for k in cfg.lengths} | {int(draft["length"])})
        settings = [{**draft, "length": lengths[-1]}]
    context = [t for p in prompts for t in p][: int(cfg.context)]
    curves, sources = cost_curves(chain, context, cfg)
    start, runs = time.perf_counter(), []
    for setting in settings:
        apply(chain, {"mu": {name: mu_max for name in configured["mu"]}, "draft": setting})
        runs.append([chain.generate(p, int(cfg.max_new_tokens), eos_token_id=eos).stats for p in prompts])
    apply(chain, configured)
    n, pooled = len(chain.levels), [s for run in runs for s in run]
    scales = []  # per verifying level, in-chain seconds over the curve's (a prompt's prefill is outside the curve)
    for i, curve in enumerate(curves):
        inside = [(k, t) for s in pooled for k, t in s.levels[i].forwards if k <= max(curve)]
        scales.append(sum(t for _, t in inside) / sum(forward_cost(curve, k) for k, _ in inside) if inside else 1.0)
    curves = [{k: v * scale for k, v in curve.items()} for curve, scale in zip(curves, scales)]
    shapes = []
    for setting, stats in zip(settings, runs):
        calls = sum(s.levels[-1].forward_calls for s in stats)
        cost = sum(s.levels[-1].draft_time_s for s in stats) / max(calls, 1)
        beta, size = _per_round(stats, n - 2, "beta"), _per_round(stats, n - 2, "size")
        accepted = _accepted(stats, n - 2)
        if setting["mode"] == "tree":
            shapes.append(Shape(setting, accepted, size, beta, cost))
        else:
            shapes += [Shape({**setting, "length": k}, capped(accepted, {k: 1.0}), min(size, k), min(beta, k), cost)
                       for k in lengths]
    model = ChainModel(curves, [_accepted(pooled, i) for i in range(n - 2)], shapes)
    measured = {
        "prompts": len(prompts), "max_new_tokens": int(cfg.max_new_tokens), "decodes": len(settings) * len(prompts),
        "mu": mu_max, "seconds": time.perf_counter() - start,
        "costs": {l.name: {"source": src, "scale": scale, "ms": {k: 1e3 * v for k, v in curve.items()}}
                  for l, src, scale, curve in zip(chain.levels, sources, scales, curves)},
    }
    return model, measured


def plan_chain(chain: Chain, prompts: list[list[int]], cfg: Any, eos: Any) -> dict[str, Any]:
    """Calibrate, then the planned knobs next to the configured ones, each with its predicted time and its
    predicted speedup over AR (the target's 1-token forward, from the same curve). A plan predicted less
    than `cfg.min_gain` faster keeps the configured values: the calibration is short and noisy."""
    configured = knobs(chain)
    model, calibration = calibrate(chain, prompts, cfg, eos)
    mine = predict(model, list(configured["mu"].values()), next(s for s in model.shapes if s.draft == configured["draft"]))
    mus, shape, predicted = best(model, [int(m) for m in cfg.mu])
    planned = {"mu": dict(zip(configured["mu"], mus)), "draft": shape.draft}
    if predicted["s_per_token"] > (1 - float(cfg.min_gain)) * mine["s_per_token"]:
        planned, predicted = configured, mine
    ar = forward_cost(model.curves[0], 1)
    return {
        "configured": {"knobs": configured, "predicted": mine | {"speedup": ar / mine["s_per_token"]}},
        "planned": {"knobs": planned, "predicted": predicted | {"speedup": ar / predicted["s_per_token"]}},
        "candidates": len(model.shapes) * len(cfg.mu) ** (len(chain.levels) - 2),
        "calibration": calibration,
    }
