"""decode.chains.plan: the acceptance model, the prediction it feeds the refined formula, and the minimiser, on
synthetic calibrations; then a calibration of a real (tiny) chain."""
from __future__ import annotations

import dataclasses

import pytest

from decode.chains.plan import (Calibration, _draft_cost, _overhead, _per_round, _prefill, _upper_overheads,
                               at_measured_acceptance, decode_interleaved, plan_chains)
from decode.engine.levels import GenerationStats, LevelStats
from decode.engine.planner import ChainModel, Shape, best, capped, first_passage, predict
from decode.settings import PlanSettings


def test_first_passage_hands_up_the_buffer_that_first_reaches_mu():
    assert first_passage({2: 1.0}, 3) == {4: 1.0}  # 0 -> 2 -> 4
    assert first_passage({1: 1.0}, 3) == {3: 1.0}
    # gains 1 or 3 with p = 1/2, mu = 2: 3 at once (1/2); 1 then 1 -> 2 (1/4); 1 then 3 -> 4 (1/4)
    assert first_passage({1: 0.5, 3: 0.5}, 2) == pytest.approx({3: 0.5, 2: 0.25, 4: 0.25})


def test_capped_is_the_distribution_of_the_minimum():
    assert capped({0: 0.5, 5: 0.5}, {3: 1.0}) == {0: 0.5, 3: 0.5}
    assert capped({2: 1.0}, {1: 0.5, 4: 0.5}) == {1: 0.5, 2: 0.5}


def test_two_level_prediction_by_hand():
    # the target accepts 2 of a 3-token draft a round (L = 3) and feeds 1 + 3 tokens: 12 ms; drafter 3 x 1 ms
    model = ChainModel([{1: 0.010, 4: 0.012}], [], [])
    shape = Shape({"mode": "chain", "length": 3}, {2: 1.0}, 3, 3, 0.001)
    p = predict(model, (), shape)
    assert p["L"] == [3] and p["P"] == [] and p["costs_s"] == pytest.approx([0.012, 0.001])
    assert p["s_per_token"] == pytest.approx((0.012 + 3 * 0.001) / 3)
    busy = dataclasses.replace(shape, overhead=0.0015)  # the engine's own 1.5 ms a round, beside the forwards
    assert predict(model, (), busy)["s_per_token"] == pytest.approx((0.012 + 3 * 0.001 + 0.0015) / 3)
    # the drafter reads the prompt once a turn: 0.05 s over a 50-token turn is 1 ms on every token
    reading = dataclasses.replace(model, prefill=0.05 / 50)
    assert predict(reading, (), shape)["s_per_token"] == pytest.approx((0.012 + 3 * 0.001) / 3 + 0.001)


def test_a_lower_levels_reading_of_the_prompt_is_prefill_not_a_draft():
    # the drafter's first forward reads the 40-token prompt (50 ms), then 4 drafts of 1 ms over 2 rounds; the
    # middle level's first forward reads it too (30 ms). Counted as drafts, they would make a draft cost 10.8 ms.
    levels = [LevelStats("target", "model", acceptance_lengths=[2, 3]),
              LevelStats("w4", "model", forwards=[(40, 0.03), (3, 0.004)], acceptance_lengths=[2, 1]),
              LevelStats("head", "eagle", forward_calls=5, draft_time_s=0.054,
                         forwards=[(40, 0.05)] + [(1, 0.001)] * 4)]
    stats = GenerationStats(wall_time_s=1.0, time_to_first_token_s=0.2, new_tokens=5, levels=levels)
    assert _prefill([stats, stats]) == pytest.approx(0.08)
    assert _draft_cost([stats]) == pytest.approx(0.001)
    assert _per_round([stats], 1, "beta") == pytest.approx(4 / 2)
    lookup = LevelStats("lookup", "ngram", forward_calls=4, draft_time_s=0.0002)  # model-free: no prompt to read
    without = GenerationStats(wall_time_s=1.0, time_to_first_token_s=0.2, new_tokens=5, levels=levels[:2] + [lookup])
    assert _draft_cost([without]) == pytest.approx(0.00005) and _per_round([without], 1, "beta") == pytest.approx(2)


def test_overhead_is_charged_per_round_of_the_level_that_spends_it():
    # 1.0 s wall, 0.2 s prefill, forwards 0.3 + 0.1 + 0.2 s: 0.2 s beside them. The target's own work (0.04 s)
    # is per its 2 rounds; the rest (0.16 s) per the middle level's 4 rounds.
    levels = [LevelStats("target", "model", verify_time_s=0.3, bookkeeping_time_s=0.04, acceptance_lengths=[3, 2]),
              LevelStats("w4", "model", draft_time_s=0.1, verify_time_s=0.2, acceptance_lengths=[1, 2, 1, 3]),
              LevelStats("head", "eagle", draft_time_s=0.0)]
    stats = GenerationStats(wall_time_s=1.0, time_to_first_token_s=0.2, new_tokens=5, levels=levels)
    assert stats.beside_forwards_s == pytest.approx(0.2)
    assert _upper_overheads([stats, stats], last=1) == pytest.approx((0.08 / 4,))
    assert _overhead([stats, stats], last=1) == pytest.approx(0.32 / 8)
    assert _upper_overheads([stats], last=0) == () and _overhead([stats], last=0) == pytest.approx(0.2 / 2)
    # A prediction then pays the target's work (2.0) per target round and the rest (0.5) per middle round: a
    # larger mu adds middle rounds, not target ones (one pooled number per middle round would charge both alike)
    model = ChainModel([{1: 10.0, 5: 10.0}, {1: 1.0, 3: 1.0}], [{1: 1.0}],
                       [Shape({"mode": "chain", "length": 2}, {1: 1.0}, 2, 2, 0.25, overhead=0.5)], overheads=(2.0,))
    # the middle level gains 2 a round and the target keeps 1 of what it is handed (L_1 = 2, R_1 = 1/2 a token).
    # mu 1: 2 handed up a middle round, R_2 = 1/2; mu 4: 4 every 2 middle rounds, R_2 = 1/2 * 4 / 2 = 1
    assert predict(model, (1,), model.shapes[0])["s_per_token"] == pytest.approx(0.5 * (10 + 2) + 0.5 * (1 + 0.5 + 0.5))
    assert predict(model, (4,), model.shapes[0])["s_per_token"] == pytest.approx(0.5 * (10 + 2) + 1 * (1 + 0.5 + 0.5))


def test_three_level_prediction_by_hand():
    # drafter: 2-token drafts of which the middle level accepts 1 (gain 2); mu = 3 -> the middle hands up
    # 4 tokens after 2 rounds; the target accepts 2 of them (L_1 = 3) feeding 1 + 4 tokens.
    model = ChainModel([{1: 10.0, 5: 14.0}, {1: 2.0, 3: 3.0}], [{2: 1.0}], [])
    shape = Shape({"mode": "chain", "length": 2}, {1: 1.0}, 2, 2, 0.5)
    p = predict(model, (3,), shape)
    assert p["L"] == [3, 2] and p["P"] == [4]
    assert p["costs_s"] == pytest.approx([14.0, 3.0, 0.5])
    # R_1 = 1/3, R_2 = R_1 * 4 / 2 = 2/3, drafter 2 * R_2 = 4/3 forwards a token
    assert p["s_per_token"] == pytest.approx(14 / 3 + 2 / 3 * 3 + 4 / 3 * 0.5)


def _decode(levels: list[LevelStats], tokens: int) -> GenerationStats:
    return GenerationStats(wall_time_s=1.0, time_to_first_token_s=0.1, new_tokens=tokens + 1, levels=levels)


def test_a_plans_costs_on_the_measured_acceptance_reproduce_its_prediction_and_follow_the_acceptance():
    """The cost model alone: a decode that measured what the plan assumed gives the plan's own prediction; one that
    accepted less costs what the plan's costs say at that acceptance, not at the plan's."""
    model = ChainModel([{1: 0.010, 4: 0.012}], [], [])
    shape = Shape({"mode": "chain", "length": 3}, {2: 1.0}, 3, 3, 0.001, overhead=0.0005)
    predicted = predict(model, (), shape)
    calibration = {"costs": {"target": {"ms": {1: 10.0, 4: 12.0}}}, "prefill_ms": 50.0}  # 50 ms a turn's prompt

    def drafter():  # its prompt reading, then 3 drafts a round for 4 rounds
        return LevelStats("draft", "model", forward_calls=13, forwards=[(40, 0.05)] + [(1, 0.001)] * 12)

    as_planned = _decode([LevelStats("target", "model", forwards=[(4, 0.012)] * 4, acceptance_lengths=[3] * 4,
                                     proposed=12), drafter()], tokens=12)
    assert at_measured_acceptance(predicted, calibration, [as_planned]) == pytest.approx(
        predicted["s_per_token"] + 0.05 / 12)
    none_kept = _decode([LevelStats("target", "model", forwards=[(4, 0.012)] * 4, acceptance_lengths=[1] * 4,
                                    proposed=12), drafter()], tokens=4)
    assert at_measured_acceptance(predicted, calibration, [none_kept]) == pytest.approx(
        0.012 + 3 * 0.001 + 0.0005 + 0.05 / 4)
    # three levels (test_three_level_prediction_by_hand's): the middle level's prompt reading is not a verify
    model = ChainModel([{1: 10.0, 5: 14.0}, {1: 2.0, 3: 3.0}], [{2: 1.0}], [])
    predicted = predict(model, (3,), Shape({"mode": "chain", "length": 2}, {1: 1.0}, 2, 2, 0.5))
    calibration = {"costs": {"target": {"ms": {1: 1e4, 5: 1.4e4}}, "mid": {"ms": {1: 2e3, 3: 3e3}}}, "prefill_ms": 0}
    levels = [LevelStats("target", "model", forwards=[(5, 14.0)] * 2, acceptance_lengths=[3] * 2, proposed=8),
              LevelStats("mid", "model", forwards=[(40, 9.0)] + [(3, 3.0)] * 4, acceptance_lengths=[2] * 4, proposed=8),
              LevelStats("draft", "model", forward_calls=9, forwards=[(40, 9.0)] + [(1, 0.5)] * 8)]
    assert at_measured_acceptance(predicted, calibration, [_decode(levels, 6)]) == pytest.approx(
        predicted["s_per_token"])


def _chain_shapes(accepted: dict[int, float], lengths: list[int], cost: float) -> list[Shape]:
    return [Shape({"mode": "chain", "length": k}, capped(accepted, {k: 1.0}), k, k, cost) for k in lengths]


def test_best_picks_the_draft_length_that_minimises_on_a_synthetic_curve():
    # flat up to 4 tokens, then 2.5 per token; the target accepts 5 of any longer draft; drafter 1 per forward.
    # time/token(K) = (T(1 + K) + K) / (1 + min(5, K)): K=1 5.5, 2 4.0, 3 3.25, 4 3.3, 5 3.33, 6 3.92 -> K = 3
    model = ChainModel([{1: 10.0, 2: 10.0, 4: 10.0, 8: 20.0, 16: 40.0}], [],
                       _chain_shapes({5: 1.0}, [1, 2, 3, 4, 5, 6, 8], 1.0))
    mus, shape, p = best(model, [1, 2, 4])
    assert mus == () and shape.draft["length"] == 3 and p["s_per_token"] == pytest.approx(13 / 4)
    flat = ChainModel([{1: 10.0}], [], model.shapes)  # flat cost: longer drafts pay until acceptance stops at 5
    assert best(flat, [1])[1].draft["length"] == 5


def test_best_picks_mu_for_a_middle_level():
    # the target keeps 3 of whatever the middle level hands up; each target forward costs 10 + 1 per token fed,
    # each middle round 1 (2 tokens gained). mu = 1 or 2 -> buffer 2: (13 + 1 + 1) / 3 = 5;
    # mu = 3 or 4 -> buffer 4: (15 + 2 * 1 + 2 * 1) / 4 = 4.75; mu = 6 -> buffer 6: (17 + 3 + 3) / 4 = 5.75
    model = ChainModel([{1: 11.0, 2: 12.0}, {1: 1.0}], [{3: 1.0}],
                       [Shape({"mode": "chain", "length": 1}, {1: 1.0}, 1, 1, 1.0)])
    mus, _, p = best(model, [1, 2, 3, 4, 6])
    assert mus == (3,) and p["s_per_token"] == pytest.approx(4.75)
    assert predict(model, (6,), model.shapes[0])["s_per_token"] == pytest.approx(5.75)


def test_calibrations_decode_prompt_by_prompt_every_chain_in_turn():
    """The host's load changes from second to second: each prompt is decoded by every chain's settings before the
    next prompt, so no chain's calibration sits in a moment of its own."""
    from types import SimpleNamespace

    calls = []

    class Decodes:
        def __init__(self, name: str):
            self.name = name

        def generate(self, prompt, max_new_tokens, eos_token_id=None):
            calls.append((self.name, prompt[0]))
            return SimpleNamespace(stats=f"{self.name} {prompt[0]}")

    two = Calibration(None, None, [{}, {}], [], 1, [Decodes("a1"), Decodes("a2")], ([], []))
    one = Calibration(None, None, [{}], [], 1, [Decodes("b")], ([], []))
    decode_interleaved([two, one], [[0], [1]], 4, eos=None)
    assert calls == [("a1", 0), ("a2", 0), ("b", 0), ("a1", 1), ("a2", 1), ("b", 1)]
    assert two.runs == [["a1 0", "a1 1"], ["a2 0", "a2 1"]] and one.runs == [["b 0", "b 1"]] and two.seconds > 0


def test_plan_chains_calibrates_real_chains_and_predicts_the_configured_values(one_thread):
    from decode.engine.chain import Chain
    from decode.engine.levels import ModelLevel
    from decode.engine.spec import ChainSpec
    from decode_fixtures import noisy_copy, prompts, tiny_model

    target = tiny_model(0)
    models = {"target": target, "mid": noisy_copy(target, 0.05, 1), "draft": noisy_copy(target, 0.3, 2)}
    spec = ChainSpec.parse([{"name": "target"}, {"name": "mid", "model": "mid", "mu": 2},
                            {"name": "draft", "model": "draft", "draft": {"mode": "chain", "length": 3}}])
    built: list[ChainSpec] = []

    def build(variant: ChainSpec) -> Chain:  # the spec's chain on the models above (a ChainBuilder loads them instead)
        built.append(variant)
        return Chain([ModelLevel(level.name, models[level.model], level.mu, level.draft) for level in variant.levels])

    settings = PlanSettings(mu=(1, 2, 4), lengths=(1, 2, 4), min_gain=0.0, ks=(1, 4, 8), repeats=1, context=32,
                            max_new_tokens=12)
    pair = ChainSpec.parse([{"name": "target"},
                            {"name": "draft", "model": "draft", "draft": {"mode": "chain", "length": 3}}])
    plans = plan_chains({"three": spec, "pair": pair}, build, prompts(300, n=2), settings, eos=None, turn_tokens=11)
    plan = plans["three"]
    assert list(plans) == ["three", "pair"] and plans["pair"]["candidates"] == 4  # lengths 1, 2, 4 and its own 3
    assert plan["configured"]["knobs"] == {"mu": {"mid": 2}, "draft": {"mode": "chain", "length": 3}}
    # the spec is never changed: variants are new ones
    assert spec.knobs() == plan["configured"]["knobs"] and built[0] == spec
    assert {v.knobs()["mu"]["mid"] for v in built[1:] if v.knobs()["mu"]} == {4}  # calibration runs at the largest mu
    planned = plan["planned"]["knobs"]
    assert planned["mu"]["mid"] in (1, 2, 4) and planned["draft"]["length"] in (1, 2, 3, 4)
    assert plan["planned"]["predicted"]["s_per_token"] <= plan["configured"]["predicted"]["s_per_token"]
    assert plan["candidates"] == 3 * 4 and plan["calibration"]["decodes"] == 2
    assert set(plan["calibration"]["costs"]) == {"target", "mid"}
    assert all(c["source"] == "timed" and c["scale"] > 0 for c in plan["calibration"]["costs"].values())
    assert plan["planned"]["predicted"]["speedup"] > 0
    overheads = plan["calibration"]["overhead_ms"]  # a real engine spends time beside its forwards, at every level
    assert len(overheads["upper levels"]) == 1 and overheads["upper levels"][0] > 0
    assert list(overheads["last verifier"]) == ["length 4"] and overheads["last verifier"]["length 4"] > 0
    assert plan["calibration"]["prefill_ms"] > 0 and plan["calibration"]["turn_tokens"] == 11
    cautious = plan_chains({"three": spec}, build, prompts(300, n=2), dataclasses.replace(settings, min_gain=0.99),
                           eos=None, turn_tokens=11)["three"]
    assert cautious["planned"] == cautious["configured"]  # not predicted 99% faster: keep the configured values


def test_the_plan_reads_a_costs_json_row_only_for_the_level_as_it_runs(one_thread, tmp_path):
    """A W4 level on int8 LM-head rows is timed here where costs.json has only the fp32 head's row "w4"; with a
    "w4 int8 head" row it reads that one. The target reads its own row, unless that lacks a width the plan times."""
    import json

    from decode.engine.chain import Chain
    from decode.engine.levels import ModelLevel
    from decode.engine.spec import ChainSpec
    from decode_fixtures import noisy_copy, prompts, tiny_model

    target = tiny_model(0)
    models = {"target": target, "w4": noisy_copy(target, 0.05, 1), "draft": noisy_copy(target, 0.3, 2)}
    spec = ChainSpec.parse([{"name": "target"}, {"name": "w4", "model": "w4", "lm_head": "int8", "mu": 2},
                            {"name": "draft", "model": "draft", "draft": {"mode": "chain", "length": 2}}])

    def build(variant: ChainSpec) -> Chain:
        return Chain([ModelLevel(level.name, models[level.model], level.mu, level.draft) for level in variant.levels])

    curve = {"1": 5.0, "4": 6.0, "8": 7.0}
    costs = tmp_path / "costs.json"
    settings = PlanSettings(mu=(1, 2), lengths=(1, 2), min_gain=0.0, ks=(1, 4, 8), repeats=1, context=32,
                            max_new_tokens=6, costs=costs)
    gappy = {"1": 5.0, "8": 7.0}  # timed without k 4: read linearly from 1 to 8 it would price 4 tokens blind
    cases = {"fp32 head row": {"target": curve, "w4": curve},
             "int8 head row": {"target": curve, "w4": curve, "w4 int8 head": curve},
             "target row without k 4": {"target": gappy, "w4 int8 head": curve}}
    sources = {}
    for case, rows in cases.items():
        costs.write_text(json.dumps({"ms": rows}))
        plan = plan_chains({"w4": spec}, build, prompts(300, n=1), settings, eos=None, turn_tokens=5)["w4"]
        sources[case] = {name: c["source"] for name, c in plan["calibration"]["costs"].items()}
    assert sources["fp32 head row"] == {"target": "costs.json target", "w4": "timed"}
    assert sources["int8 head row"] == {"target": "costs.json target", "w4": "costs.json w4 int8 head"}
    assert sources["target row without k 4"] == {"target": "timed", "w4": "costs.json w4 int8 head"}
