"""Theorems 3.1 and 3.2 (and the refined prediction) against the paper's Table 1 (docs/design.md, "Theory") and
hand-computed chains."""
from __future__ import annotations

import math
import re
from decimal import ROUND_DOWN, Decimal

import pytest

from decode.engine.theory import (
    InsertionCase,
    TheoryError,
    forward_cost,
    insertion_conditions,
    insertion_improves,
    predicted_speedup,
    predicted_time,
    refined_time,
)


def printed(value: float, text: str) -> bool:
    """True when `value`, truncated to the decimals of `text`, prints as `text` (the paper truncates)."""
    exponent = Decimal(text).as_tuple().exponent
    return Decimal(repr(value)).quantize(Decimal(1).scaleb(exponent), rounding=ROUND_DOWN) == Decimal(text)


# case, (T_i, L_i-new, T_new, L_new, T_i+1, L_i), printed lhs, printed rhs, which form printed the rhs,
# L_new-(i+1) for the second condition (beta = 1), speedup before -> after, compliant
TABLE_1 = [
    ("Vicuna-7B <- Vicuna-1B <- EAGLE", (22, 3.83, 17.61, 3.77, 4, 4.34),
     "0.80", "-0.117", "second", 3.83, (2.61, 1.08), False),
    ("Vicuna-7B <- W4A4 Vicuna-7B <- EAGLE", (22, 6.26, 7.00, 4.67, 4, 4.34),
     "0.318", "0.330", "first", 4.67, (2.61, 3.48), True),
    ("FLAN-T5-XXL <- base <- small", (47.52, 3.50, 19.16, 3.02, 12.42, 2.28),
     "0.403", "0.461", "first", 3.02, (3.19, 3.88), True),
]


@pytest.mark.parametrize("case,values,lhs,rhs,form,l_new_next,speedups,compliant", TABLE_1, ids=[r[0] for r in TABLE_1])
def test_table_1_rows_reproduce_to_the_printed_digits(case, values, lhs, rhs, form, l_new_next, speedups, compliant):
    result = insertion_conditions(InsertionCase(*values, draft_depth=1, l_new_next=l_new_next))
    assert printed(result.lhs_first, lhs)
    assert printed(result.rhs_first if form == "first" else result.rhs_second, rhs)
    assert result.improves is compliant
    # the verdict agrees with what the paper measured: the speedup rose exactly for compliant insertions
    assert (speedups[1] > speedups[0]) is compliant


def test_row_1_rhs_is_not_the_first_condition():
    """Documents the reading in decode/theory.py: the first form gives -0.11567, which prints as -0.115/-0.116."""
    result = insertion_conditions(InsertionCase(22, 3.83, 17.61, 3.77, 4, 4.34, draft_depth=1, l_new_next=3.83))
    assert result.rhs_first == pytest.approx(-0.115671, abs=1e-6)
    assert not printed(result.rhs_first, "-0.117")
    assert result.rhs_second == pytest.approx(3.83 / 4.34 - 1)
    assert not result.first_holds and not result.second_holds


def test_truncation_not_rounding_is_the_printing_rule():
    result = insertion_conditions(InsertionCase(47.52, 3.50, 19.16, 3.02, 12.42, 2.28, draft_depth=1, l_new_next=3.02))
    assert round(result.rhs_first, 3) == 0.462  # rounding would not give the printed 0.461
    assert printed(result.rhs_first, "0.461")


def test_theorem_3_1_by_hand():
    # 3 levels: 100 tokens, T = (10, 4, 1) ms, L = (5, 2.5), beta = 4
    # = 100/5*10 + 100/2.5*4 + 4*100/2.5*1 = 200 + 160 + 160
    assert predicted_time([10, 4, 1], [5, 2.5], 4, 100) == pytest.approx(520)
    assert predicted_time([10], [], 4, 100) == pytest.approx(1000)  # autoregressive: N * T_1
    assert predicted_speedup([10, 4, 1], [5, 2.5], 4, target_time=10) == pytest.approx(1000 / 520)


def test_nothing_accepted_means_no_speedup_from_verification():
    """L = 1 is legal (the verifier's own token only): each token costs a full verification plus drafting."""
    assert predicted_time([10, 1], [1], 3, 50) == pytest.approx(50 * 10 + 3 * 50 * 1)
    assert predicted_speedup([10, 1], [1], 3, target_time=10) < 1


def test_direct_test_matches_closed_form_when_it_is_exact():
    """Inserting above a level that is not the drafter: the first condition is exactly Theorem 3.1's comparison."""
    without = ([20, 5, 1], [3.0, 2.0], 4)  # M_1 <- M_2 <- drafter; insert between M_1 and M_2
    for t_new, l_i_new, l_new in [(2, 6.0, 2.5), (9, 3.5, 1.2), (4, 4.0, 2.0)]:
        with_new = ([20, t_new, 5, 1], [l_i_new, l_new, 2.0], 4)
        direct = insertion_improves(without, with_new, new_tokens=100)
        closed = insertion_conditions(InsertionCase(20, l_i_new, t_new, l_new, 5, 3.0, draft_depth=4, l_new_next=l_new))
        assert direct.improves is closed.first_holds
        assert direct.time_without == pytest.approx(predicted_time(*without, new_tokens=100))


def test_direct_test_on_table_1_with_unit_depth():
    for _, (t_i, l_i_new, t_new, l_new, t_next, l_i), *_rest, compliant in TABLE_1:
        direct = insertion_improves(([t_i, t_next], [l_i], 1), ([t_i, t_new, t_next], [l_i_new, l_new], 1))
        assert direct.improves is compliant


@pytest.mark.parametrize("kwargs,message", [
    (dict(l_i=0.9), "L_i must be >= 1"),
    (dict(l_new=0), "L_new must be >= 1"),
    (dict(t_new=0), "T_new must be a positive time"),
    (dict(t_i=-3), "T_i must be a positive time"),
    (dict(t_next=None), "T_i+1 is missing"),
    (dict(l_i_new=None), "L_i-new is missing"),
    (dict(draft_depth=None), "beta (draft depth) is missing"),
    (dict(draft_depth=0), "beta (draft depth) must be positive"),
    (dict(l_new_next=math.nan), "L_new-(i+1) must be finite"),
    (dict(t_i="22"), "T_i must be a number"),
])
def test_insertion_rejects_bad_values_with_one_line(kwargs, message):
    values = dict(t_i=22, l_i_new=6.26, t_new=7.0, l_new=4.67, t_next=4, l_i=4.34, draft_depth=1, l_new_next=4.67)
    with pytest.raises(TheoryError, match=re.escape(message)) as err:
        insertion_conditions(InsertionCase(**{**values, **kwargs}))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("args,message", [
    (([10, 0], [2], 3, 10), "T_2 must be a positive time"),
    (([10, 1], [0.5], 3, 10), "L_1 must be >= 1"),
    (([10, 1], [], 3, 10), "need 1 acceptance lengths"),
    (([10, 1], None, 3, 10), "need 1 acceptance lengths"),
    (([], [], 3, 10), "forward times are missing"),
    (([10, 1], [2], 3, 0), "N must be positive"),
    (([10, 1], [2], -1, 10), "beta"),
    (([10, None], [2], 3, 10), "T_2 is missing"),
])
def test_predicted_time_rejects_bad_values(args, message):
    with pytest.raises(TheoryError, match=message):
        predicted_time(*args)


# ------------------------------------------------------------------------------------ refined prediction


def test_refined_reduces_to_theorem_3_1_on_two_levels_with_flat_costs():
    for t, lengths, beta, n in [([10, 1], [3.0], 4, 100), ([22, 4], [4.34], 1, 7), ([5, 0.5], [1.0], 6, 64)]:
        assert refined_time(lengths, [], beta, n, t) == pytest.approx(predicted_time(t, lengths, beta, n))
    assert refined_time([], [], 0, 50, [10]) == pytest.approx(predicted_time([10], [], 1, 50))  # AR: N * T_1


def test_refined_three_levels_by_hand():
    # 100 tokens; target accepts 4 a round (L_1 = 4): 25 rounds of 10 ms. The middle level hands up
    # P_2 = 6 tokens a round of the target (150 tokens made, of which the target keeps ~75 + 25 bonus), at
    # L_2 = 2 a round: 75 rounds of 4 ms. Drafter: beta = 3 forwards a middle round, 225 of 1 ms.
    assert refined_time([4, 2], [6], 3, 100, [10, 4, 1]) == pytest.approx(250 + 300 + 225)
    # Theorem 3.1 charges the middle level N / L_2 = 50 rounds, as if every token it made were kept
    assert predicted_time([10, 4, 1], [4, 2], 3, 100) == pytest.approx(250 + 200 + 150)


def test_refined_four_levels_multiplies_what_each_level_hands_up():
    # R_1 = 10/2 = 5; R_2 = 5 * 3 / 1.5 = 10; R_3 = 10 * 2 / 2 = 10; drafter 2 * 10 = 20 forwards
    assert refined_time([2, 1.5, 2], [3, 2], 2, 10, [8, 4, 2, 1]) == pytest.approx(5 * 8 + 10 * 4 + 10 * 2 + 20 * 1)
    # the engine's own work: 0.5 a round of the last verifying level (R_3 = 10 rounds), beside the forwards
    assert refined_time([2, 1.5, 2], [3, 2], 2, 10, [8, 4, 2, 1], 0.5) == pytest.approx(120 + 10 * 0.5)
    # or per round of each verifying level: 5 rounds of the target at 0.4, 10 of each middle level at 0.1 and 0.5
    assert refined_time([2, 1.5, 2], [3, 2], 2, 10, [8, 4, 2, 1], [0.4, 0.1, 0.5]) == pytest.approx(
        120 + 5 * 0.4 + 10 * 0.1 + 10 * 0.5)


@pytest.mark.parametrize("args,message", [
    (([2], [], 3, 10, [10]), "need 0 acceptance lengths"),
    (([2, 2], [], 3, 10, [10, 4, 1]), "need 1 hand-up sizes"),
    (([2, 2], [0], 3, 10, [10, 4, 1]), "P_2 must be positive"),
    (([0.5], [], 3, 10, [10, 1]), "L_1 must be >= 1"),
    (([2], [], 3, 10, [10, 0]), "c_2 must be a positive time"),
    (([], [], 3, 10, []), "forward costs are missing"),
    (([2], [], 3, 10, [10, 1], -0.1), "overhead must be >= 0"),
    (([2], [], 3, 10, [10, 1], [-0.1]), "overhead must be >= 0"),
    (([2, 2], [3], 3, 10, [10, 4, 1], [0.1]), "need one overhead or 2 (one per verifying level), got 1"),
])
def test_refined_rejects_bad_values(args, message):
    with pytest.raises(TheoryError, match=re.escape(message)):
        refined_time(*args)


def test_forward_cost_interpolates_and_extrapolates_upwards():
    curve = {1: 10.0, 4: 16.0, 8: 24.0}
    assert forward_cost(curve, 1) == 10.0 and forward_cost(curve, 0.5) == 10.0
    assert forward_cost(curve, 2.5) == pytest.approx(13.0) and forward_cost(curve, 6) == pytest.approx(20.0)
    assert forward_cost(curve, 12) == pytest.approx(32.0)  # the last slope, 2 per token
    assert forward_cost({1: 10.0, 8: 9.0}, 16) == 9.0  # a noisy falling last segment does not extrapolate down
    assert forward_cost({3: 5.0}, 10) == 5.0
