"""The planner's model of a chain (pure): from calibrated acceptance distributions, cost curves and drafter shapes,
the refined prediction (engine.theory.refined_time) of seconds per token for any middle-level mus and draft shape.

The last verifying level gains A + 1 tokens a round; a middle level hands up its pending buffer when it first holds
>= mu tokens (first passage); the level above accepts min(C, buffer) of it and feeds buffer + 1 tokens a forward.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Sequence

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
    overhead: float = 0.0  # seconds per round of the last verifying level beside the forwards: its own work, the
    # drafter's (a tree's building grows with its shape) and the engine loop's


@dataclass(frozen=True)
class ChainModel:
    curves: list[dict[int, float]]  # per verifying level (target first): seconds per forward at k tokens fed
    accepted: list[Dist]  # per verifying level but the last: tokens accepted of what the level below hands up
    shapes: list[Shape]
    overheads: tuple[float, ...] = ()  # per verifying level but the last: its own seconds per round beside forwards
    prefill: float = 0.0  # seconds per token of the lower levels reading the prompt (once a turn, spread over it)


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
    upper = list(model.overheads) or [0.0] * (n - 1)
    seconds = refined_time(lengths, handed_up, shape.beta, 1, costs + [shape.cost], upper + [shape.overhead])
    return {"s_per_token": seconds + model.prefill, "L": lengths, "P": handed_up, "beta": shape.beta,
            "costs_s": costs + [shape.cost], "overheads_s": upper + [shape.overhead]}


def best(model: ChainModel, mu_grid: Sequence[int]) -> tuple[tuple[int, ...], Shape, dict[str, Any]]:
    """The (mus, shape) with the least predicted time, over every mu of the grid for every middle level."""
    options = itertools.product(itertools.product(mu_grid, repeat=len(model.curves) - 1), model.shapes)
    return min(((mus, shape, predict(model, mus, shape)) for mus, shape in options), key=lambda o: o[2]["s_per_token"])
