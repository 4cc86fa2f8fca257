"""The cost theory of polybasic speculative decoding (docs/design.md, "Theory"): pure functions, no torch.

Chain M_1 (target) ... M_n (cheapest drafter). T_i: time of one forward pass of M_i; L_i: mean
acceptance length of M_i on what M_{i+1} proposed (bonus token included, so L_i >= 1); beta: drafter
forward passes per verification round of M_{n-1}; N: tokens generated.

Theorem 3.1:  T = sum_{i=1}^{n-1} (N / L_i) * T_i + beta * (N / L_{n-1}) * T_n
Theorem 3.2:  inserting M_new between M_i and M_{i+1} lowers T if
                T_new / T_i     < L_new * (1/L_i - 1/L_{i-new})          (first condition)   or
                T_new / T_{i+1} < beta * (L_{new-(i+1)} / L_i - 1)       (second condition)

The two closed forms split one inequality into two sufficient-looking halves; `insertion_improves`
is the direct test they approximate: Theorem 3.1's time with M_new against its time without it.

Refined prediction (`refined_time`): Theorem 3.1 charges a middle level N / L_i rounds, as if every
token it accepts reached the output. It does not: level i hands its pending buffer (P_i tokens a
round of level i-1, P_i >= mu_i) up, and the level above keeps only a prefix. Counting rounds from
what each level hands up,
                R_1 = N / L_1,   R_i = R_{i-1} * P_i / L_i  (1 < i < n),   drafter: beta * R_{n-1}
                T   = sum_{i<n} R_i * c_i + beta * R_{n-1} * c_n
with c_i the level's cost of one forward at the tokens it actually carries (a verification carries the
proposal plus one token, so c_i grows with P_{i+1} on a CPU). For two levels and c_i = T_i it is
Theorem 3.1; for n levels it differs by the factor P_i / L_{i-1} per middle level.

Reading the paper's Table 1 (the rows in docs/design.md, reproduced by tests/test_theory.py): the printed
digits are truncations, not roundings (row 3's first-condition rhs is 0.46170, printed 0.461). Rows 2
and 3 print the first condition's rhs (0.33003 -> 0.330, 0.46170 -> 0.461). Row 1's printed -0.117
is *not* the first condition's rhs (-0.11567 -> -0.115 truncated, -0.116 rounded): it is the second
condition's form with beta = 1 and L_{new-(i+1)} = 3.83, the value the table prints as L_{i-new}
(3.83 / 4.34 - 1 = -0.11751 -> -0.117). Equivalently, the first form with L_{i-new} in place of
L_new. Every row's verdict is the same under either reading.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from infra.errors import PolyspecError


class TheoryError(PolyspecError, ValueError):
    """A value the theory cannot use (missing, not a number, out of range); one line, names the value."""


def _number(name: str, value: Any) -> float:
    if value is None:
        raise TheoryError(f"{name} is missing")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TheoryError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise TheoryError(f"{name} must be finite, got {value}")
    return float(value)


def _time(name: str, value: Any) -> float:
    """A forward time: strictly positive (a level that costs nothing or was never timed has no T)."""
    value = _number(name, value)
    if value <= 0:
        raise TheoryError(f"{name} must be a positive time, got {value}")
    return value


def _acceptance(name: str, value: Any) -> float:
    """An acceptance length counts the verifier's own token, so it is at least 1 (1 = nothing accepted)."""
    value = _number(name, value)
    if value < 1:
        raise TheoryError(f"{name} must be >= 1 (acceptance lengths include the bonus token), got {value}")
    return value


def _positive(name: str, value: Any) -> float:
    value = _number(name, value)
    if value <= 0:
        raise TheoryError(f"{name} must be positive, got {value}")
    return value


def predicted_time(
    forward_times: Sequence[float], acceptance: Sequence[float], draft_depth: float, new_tokens: float
) -> float:
    """Theorem 3.1: time to generate `new_tokens` with a chain of len(forward_times) levels.

    forward_times = [T_1, ..., T_n]; acceptance = [L_1, ..., L_{n-1}]. A one-level "chain" (plain
    autoregressive decoding of the target) takes N * T_1: one forward pass per token.
    """
    if forward_times is None or len(forward_times) == 0:
        raise TheoryError("forward times are missing (need T_1 .. T_n)")
    if acceptance is None or len(acceptance) != len(forward_times) - 1:
        got = "none" if acceptance is None else len(acceptance)
        raise TheoryError(f"need {len(forward_times) - 1} acceptance lengths (L_1 .. L_n-1) "
                          f"for {len(forward_times)} levels, got {got}")
    times = [_time(f"T_{i}", t) for i, t in enumerate(forward_times, 1)]
    lengths = [_acceptance(f"L_{i}", a) for i, a in enumerate(acceptance, 1)]
    n_tokens = _positive("N", new_tokens)
    if len(times) == 1:
        return n_tokens * times[0]
    beta = _positive("beta (draft depth)", draft_depth)
    verify = sum(n_tokens / length * t for length, t in zip(lengths, times[:-1]))
    return verify + beta * n_tokens / lengths[-1] * times[-1]


def refined_time(
    acceptance: Sequence[float], handed_up: Sequence[float], draft_depth: float, new_tokens: float,
    costs: Sequence[float], overhead: float | Sequence[float] = 0.0,
) -> float:
    """Decoding time with each level's rounds counted from the tokens it hands up (module docstring).

    acceptance = [L_1, ..., L_{n-1}]; handed_up = [P_2, ..., P_{n-1}] (mean tokens middle level i hands
    up per round of level i-1); costs = [c_1, ..., c_n], seconds per forward at the tokens each level
    carries (a measured mean, or a cost curve read with `forward_cost`); overhead: the engine's own seconds
    (acceptance, cache crops, drafting logic) beside the forwards, per round of M_{n-1} (one number), or
    per round of each verifying level M_1 .. M_{n-1} (n - 1 numbers: a level verifies R_i times).
    """
    n = len(costs)
    if n == 0:
        raise TheoryError("forward costs are missing (need c_1 .. c_n)")
    if acceptance is None or len(acceptance) != n - 1:
        raise TheoryError(f"need {n - 1} acceptance lengths (L_1 .. L_n-1) for {n} levels, "
                          f"got {0 if acceptance is None else len(acceptance)}")
    if handed_up is None or len(handed_up) != max(n - 2, 0):
        raise TheoryError(f"need {max(n - 2, 0)} hand-up sizes (P_2 .. P_n-1) for {n} levels, "
                          f"got {0 if handed_up is None else len(handed_up)}")
    c = [_time(f"c_{i}", t) for i, t in enumerate(costs, 1)]
    lengths = [_acceptance(f"L_{i}", a) for i, a in enumerate(acceptance, 1)]
    sizes = [_positive(f"P_{i}", p) for i, p in enumerate(handed_up, 2)]
    rounds = _positive("N", new_tokens)
    per_round = [0.0] * (n - 2) + [overhead] if isinstance(overhead, (int, float)) else list(overhead)
    if n > 1 and len(per_round) != n - 1:
        raise TheoryError(f"need one overhead or {n - 1} (one per verifying level), got {len(per_round)}")
    if any(_number("overhead", o) < 0 for o in per_round):
        raise TheoryError(f"overhead must be >= 0 seconds, got {overhead}")
    if n == 1:
        return rounds * c[0]
    total = 0.0
    for i, length in enumerate(lengths):
        rounds = rounds / length if i == 0 else rounds * sizes[i - 1] / length
        total += rounds * (c[i] + per_round[i])
    return total + _positive("beta (draft depth)", draft_depth) * c[-1] * rounds


def forward_cost(curve: dict[int, float], tokens: float) -> float:
    """A cost curve {tokens carried: seconds per forward} read at `tokens`: linear between the measured
    points, the first point's value below them, the last two points' slope above them."""
    if not curve:
        raise TheoryError("the cost curve is empty")
    ks = sorted(curve)
    if tokens <= ks[0] or len(ks) == 1:
        return curve[ks[0]]
    lo, hi = next(((a, b) for a, b in zip(ks, ks[1:]) if tokens <= b), (ks[-2], ks[-1]))
    value = curve[lo] + (curve[hi] - curve[lo]) * (tokens - lo) / (hi - lo)
    return max(value, curve[hi]) if tokens > hi else value  # a noisy last slope never extrapolates down


def predicted_speedup(
    forward_times: Sequence[float], acceptance: Sequence[float], draft_depth: float, target_time: float
) -> float:
    """Theorem 3.1's speedup over autoregressive decoding, N * T_target / T (independent of N)."""
    return predicted_time([target_time], [], 1, 1) / predicted_time(forward_times, acceptance, draft_depth, 1)


@dataclass(frozen=True)
class Insertion:
    """Theorem 3.2 evaluated for one inserted model: both closed-form conditions and the verdict."""

    lhs_first: float   # T_new / T_i
    rhs_first: float   # L_new * (1/L_i - 1/L_{i-new})
    lhs_second: float  # T_new / T_{i+1}
    rhs_second: float  # beta * (L_{new-(i+1)} / L_i - 1)

    @property
    def first_holds(self) -> bool:
        return self.lhs_first < self.rhs_first

    @property
    def second_holds(self) -> bool:
        return self.lhs_second < self.rhs_second

    @property
    def improves(self) -> bool:
        return self.first_holds or self.second_holds

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "first_holds": self.first_holds, "second_holds": self.second_holds,
                "improves": self.improves}


@dataclass(frozen=True)
class InsertionCase:
    """Theorem 3.2's eight quantities for inserting M_new between M_i and M_{i+1}, as the paper names them and in
    its table's order: T_i, L_{i-new}, T_new, L_new, T_{i+1}, L_i; then beta (the draft depth) and L_{new-(i+1)}
    for the second condition (on measured chains, L_{new-(i+1)} is L_new)."""

    t_i: float
    l_i_new: float
    t_new: float
    l_new: float
    t_next: float
    l_i: float
    draft_depth: float
    l_new_next: float


def insertion_conditions(case: InsertionCase) -> Insertion:
    """Theorem 3.2's two closed-form conditions for inserting M_new between M_i and M_{i+1}; a bad quantity is a
    one-line TheoryError naming it."""
    t_i, t_new, t_next = _time("T_i", case.t_i), _time("T_new", case.t_new), _time("T_i+1", case.t_next)
    l_i, l_i_new = _acceptance("L_i", case.l_i), _acceptance("L_i-new", case.l_i_new)
    l_new, l_new_next = _acceptance("L_new", case.l_new), _acceptance("L_new-(i+1)", case.l_new_next)
    beta = _positive("beta (draft depth)", case.draft_depth)
    return Insertion(
        lhs_first=t_new / t_i,
        rhs_first=l_new * (1 / l_i - 1 / l_i_new),
        lhs_second=t_new / t_next,
        rhs_second=beta * (l_new_next / l_i - 1),
    )


@dataclass(frozen=True)
class DirectTest:
    time_without: float
    time_with: float

    @property
    def improves(self) -> bool:
        return self.time_with < self.time_without

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "improves": self.improves}


def insertion_improves(
    without: tuple[Sequence[float], Sequence[float], float],
    with_new: tuple[Sequence[float], Sequence[float], float],
    new_tokens: float = 1.0,
) -> DirectTest:
    """The direct test: Theorem 3.1's time with M_new against without it.

    Each chain is (forward_times, acceptance, draft_depth) as `predicted_time` takes them.
    """
    return DirectTest(
        time_without=predicted_time(*without, new_tokens=new_tokens),
        time_with=predicted_time(*with_new, new_tokens=new_tokens),
    )
