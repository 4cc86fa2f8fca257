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


class TheoryError(ValueError):
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
        raise TheoryError(f"need {len(forward_times) - 1} acceptance lengths (L_1 .. L_n-1) for {len(forward_times)} levels, got {got}")
    times = [_time(f"T_{i}", t) for i, t in enumerate(forward_times, 1)]
    lengths = [_acceptance(f"L_{i}", a) for i, a in enumerate(acceptance, 1)]
    n_tokens = _positive("N", new_tokens)
    if len(times) == 1:
        return n_tokens * times[0]
    beta = _positive("beta (draft depth)", draft_depth)
    verify = sum(n_tokens / length * t for length, t in zip(lengths, times[:-1]))
    return verify + beta * n_tokens / lengths[-1] * times[-1]


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
        return {**asdict(self), "first_holds": self.first_holds, "second_holds": self.second_holds, "improves": self.improves}


def insertion_conditions(
    t_i: float, l_i_new: float, t_new: float, l_new: float, t_next: float, l_i: float,
    draft_depth: float, l_new_next: float,
) -> Insertion:
    """Theorem 3.2's two closed-form conditions for inserting M_new between M_i and M_{i+1}.

    Argument order follows the paper's table: T_i, L_{i-new}, T_new, L_new, T_{i+1}, L_i; then beta and
    L_{new-(i+1)} for the second condition (on measured chains, L_{new-(i+1)} is L_new).
    """
    t_i, t_new, t_next = _time("T_i", t_i), _time("T_new", t_new), _time("T_i+1", t_next)
    l_i, l_i_new = _acceptance("L_i", l_i), _acceptance("L_i-new", l_i_new)
    l_new, l_new_next = _acceptance("L_new", l_new), _acceptance("L_new-(i+1)", l_new_next)
    beta = _positive("beta (draft depth)", draft_depth)
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
