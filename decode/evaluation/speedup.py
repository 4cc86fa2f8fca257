"""A speedup with its confidence interval, from paired per-turn timings (decode.eval's gate, decode.bench).

Every turn is decoded by the reference and by each method back to back, so a turn's two timings share the
machine's load, and the speedup is the pooled one (the reference's seconds per token over the method's).
Its interval is a paired Student-t interval on the log of that pooled ratio, with the standard error of its
linearisation over turns (each turn's share of the reference's seconds and tokens against its share of the
method's; with equal turns, the paired t-test on per-turn log time ratios): it brackets the very number the
report prints, needs no seed, and keeps its level with the dozen turns an eval decodes, where a percentile
bootstrap is too narrow.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from statistics import NormalDist
from typing import Sequence

Timed = tuple[float, float]  # one turn of one method: (wall seconds, new tokens)
METHOD = "paired t-interval on the log of the pooled ratio, over turns"


class IntervalError(ValueError):
    """Bad interval settings or timings; callers re-raise it as their own one-line error."""


def checked_confidence(value: object) -> float:
    """A two-sided confidence level, strictly between 0 and 1."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise IntervalError(f"confidence must be a number strictly between 0 and 1, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Interval:
    """A ratio and its interval; low/high are None with fewer than 2 turns (no interval: nothing is shown)."""

    estimate: float
    low: float | None
    high: float | None
    confidence: float
    turns: int
    method: str = METHOD

    @property
    def above_one(self) -> bool:
        """Shown to be above 1 (faster) at this confidence."""
        return self.low is not None and self.low > 1

    @property
    def below_one(self) -> bool:
        return self.high is not None and self.high < 1

    def text(self) -> str:
        """'<estimate>x [<low>, <high>]', two decimals each."""
        bounds = (f"[{self.low:.2f}, {self.high:.2f}]" if self.low is not None
                  else f"[no interval: {self.turns} turn(s)]")
        return f"{self.estimate:.2f}x {bounds}"

    def verdict(self) -> str:
        """'<estimate>x [<low>, <high>]: not shown to be faster' (or: shown faster, shown slower)."""
        word = "shown faster" if self.above_one else "shown slower" if self.below_one else "not shown to be faster"
        return f"{self.text()}: {word}"

    def as_dict(self) -> dict:
        return asdict(self) | {"text": self.verdict()}

    @classmethod
    def from_dict(cls, d: dict) -> Interval:
        return cls(d["estimate"], d["low"], d["high"], d["confidence"], d["turns"], d.get("method", METHOD))


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile: exact for 1 and 2 degrees of freedom, else the Cornish-Fisher expansion
    (Abramowitz & Stegun 26.7.5; within 0.2% of the exact value at p = 0.975 for df >= 3)."""
    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    if df == 2:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    z = NormalDist().inv_cdf(p)
    terms = [(z**3 + z) / 4, (5 * z**5 + 16 * z**3 + 3 * z) / 96, (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384,
             (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160]
    return z + sum(g / df**k for k, g in enumerate(terms, 1))


def time_speedup(reference: Sequence[Timed], method: Sequence[Timed], confidence: float = 0.95) -> Interval:
    """The pooled time speedup of `method` over `reference` (turn i of one paired with turn i of the other)."""
    if len(reference) != len(method):
        raise IntervalError(f"paired timings need as many turns on both sides, got {len(reference)} and {len(method)}")
    columns = list(zip(*(r + m for r, m in zip(reference, method)))) or [()] * 4
    sums = [sum(c) for c in columns]  # reference seconds, tokens; method seconds, tokens
    if not all(sums):
        raise IntervalError("paired timings need some seconds and some tokens on both sides")
    estimate = (sums[0] / sums[1]) / (sums[2] / sums[3])
    n = len(reference)
    if n < 2:
        return Interval(estimate, None, None, confidence, n)
    shares = [a / sums[0] - b / sums[1] - c / sums[2] + d / sums[3] for a, b, c, d in zip(*columns)]
    spread = t_quantile(1 - (1 - confidence) / 2, n - 1) * math.sqrt(n / (n - 1) * sum(s * s for s in shares))
    return Interval(estimate, estimate * math.exp(-spread), estimate * math.exp(spread), confidence, n)


def ratio(numerators: Sequence[float], denominators: Sequence[float], confidence: float = 0.95) -> Interval:
    """Sum of numerators over sum of denominators, paired by turn (e.g. predicted over measured time)."""
    return time_speedup([(x, 1) for x in numerators], [(y, 1) for y in denominators], confidence)


def at_confidence(x: Interval, confidence: float) -> Interval:
    """The same paired interval (same estimate and standard error) drawn at another confidence level."""
    if x.low is None:
        return replace(x, confidence=confidence)
    df = x.turns - 1
    widen = t_quantile(1 - (1 - confidence) / 2, df) / t_quantile(1 - (1 - x.confidence) / 2, df)
    spread = math.log(x.estimate / x.low) * widen
    return replace(x, low=x.estimate * math.exp(-spread), high=x.estimate * math.exp(spread), confidence=confidence)


def holm(intervals: dict[str, Interval]) -> dict[str, Interval]:
    """Holm's step-down correction of "shown faster" (one-sided: the lower bound above 1) over every interval
    given: with m chains each tested at (1 - confidence) / 2, the chance of showing any chain faster that is not
    would grow towards m times that; Holm keeps it at that level. Chains ordered by their evidence (the t
    statistic of the log speedup), the k-th (from 0) is redrawn at the level testing it at alpha / (m - k); after
    the first not shown faster, the rest are drawn at that failing step's level, where none of them is."""
    m = len(intervals)

    def evidence(x: Interval) -> float:
        if x.low is None:
            return -math.inf
        if x.estimate <= x.low:  # no spread
            return math.inf if x.estimate > 1 else -math.inf
        return math.log(x.estimate) / math.log(x.estimate / x.low)  # t over the interval's quantile (equal turns)

    out: dict[str, Interval] = {}
    stop: float | None = None
    for k, name in enumerate(sorted(intervals, key=lambda n: evidence(intervals[n]), reverse=True)):
        x = intervals[name]
        level = stop if stop is not None else 1 - (1 - x.confidence) / (m - k)
        out[name] = at_confidence(x, level)
        if stop is None and not out[name].above_one:
            stop = level
    return {name: out[name] for name in intervals}
