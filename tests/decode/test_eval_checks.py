"""The eval's three checks and its publishing gate, on synthetic measurements (no models)."""
from __future__ import annotations

import json
import shutil

import pytest

from decode.evaluation.decoding import Record
from decode.evaluation.checks import (check_agreement, check_insertion, check_lossless, evaluate_insertion,
                                      find_insertions)
from decode.publish.bundle import clean_stale, folder_hash, gate, publish_bundle, set_aside
from decode.evaluation.aggregate import summarize, time_ratio
from decode.engine.levels import GenerationStats, LevelStats
from decode.evaluation.speedup import Interval


def record(tokens, levels, turn=0, qid=1, wall=1.0, depth=0.0):
    return Record(qid, "qa", turn, [5, 6, 7], tokens, GenerationStats(wall, 0.0, len(tokens), depth, levels))


def level(name, calls, time_s, lengths):
    return LevelStats(name, "model", forward_calls=calls, verify_time_s=time_s, acceptance_lengths=lengths)


def summary(times, lengths, beta):
    """A chain summary as decode.eval.summarize makes it, from T_i and L_i."""
    levels = [{"name": f"m{i}", "T_s": t, "L_mean": length}
              for i, (t, length) in enumerate(zip(times, [*lengths, None]))]
    return {"levels": levels, "draft_depth": beta}


def test_summarize_pools_levels_over_questions():
    recs = [
        record([1, 2, 3], [level("target", 2, 0.2, [2, 1]), level("head", 6, 0.06, [])], depth=3),
        record([4, 5, 6, 7], [level("target", 2, 0.4, [3, 1]), level("head", 4, 0.04, [])], depth=2),
    ]
    s = summarize(recs)
    target, head = s["levels"]
    assert target["T_s"] == pytest.approx(0.6 / 4) and head["T_s"] == pytest.approx(0.01)
    assert target["L_mean"] == pytest.approx(7 / 4) and target["L_var"] == pytest.approx(0.9166666)
    assert target["L_histogram"] == {1: 2, 2: 1, 3: 1}
    assert s["draft_depth"] == pytest.approx(10 / 4) and s["new_tokens"] == 7
    assert s["tokens_per_s"] == pytest.approx(3.5)
    assert time_ratio(s, {"wall_time_s": 7.0, "new_tokens": 7}) == pytest.approx(3.5)  # 1 s/token vs 2/7


def scripted_ar(after: dict[tuple, int], tie_at: tuple = (1, 2), tie: tuple[float, list[int]] = (5e-5, [3, 8])):
    """A reference_fn for a scripted target: its greedy choice after each generated prefix, a near-tie after
    `tie_at`, a clear margin everywhere else; records each call."""
    calls = []

    def reference_fn(prompt, forced, n):
        calls.append((list(prompt), list(forced), n))
        tokens, margins = [], []
        while len(tokens) < n:
            key = tuple(tokens)
            margins.append(tie if key == tie_at else (0.5, [after.get(key, 0), 99]))
            tokens.append(forced[len(tokens)] if len(tokens) < len(forced) else after.get(key, 0))
        return tokens, margins

    reference_fn.calls = calls
    return reference_fn


AFTER = {(): 1, (1,): 2, (1, 2): 3, (1, 2, 3): 4, (1, 2, 8): 4}  # AR gives 1 2 3 4; after the tie's 8, 4 again


def test_lossless_passes_equal_outputs_and_excuses_only_near_ties():
    ar = [record([1, 2, 3, 4], []), record([9, 9], [], turn=1)]
    same = [record([1, 2, 3, 4], []), record([9, 9], [], turn=1)]
    tie = [record([1, 2, 8, 4], []), record([9, 9], [], turn=1)]
    check = check_lossless({"ar": ar, "chain": same}, lambda *a: pytest.fail("no divergence to inspect"), 1e-4)
    assert check.passed and check.details["compared_turns"] == 2

    reference = scripted_ar(AFTER)
    check = check_lossless({"ar": ar, "chain": tie}, reference, 1e-4)
    assert check.passed and check.details["near_ties_excused"] == 1 and check.details["near_ties"][0]["position"] == 2
    # the margin comes from AR's own decode, teacher-forced along the common prefix; then AR goes on from the tie
    assert reference.calls == [([5, 6, 7], [1, 2], 3), ([5, 6, 7], [1, 2, 8], 4)]

    clear = check_lossless({"ar": ar, "chain": tie}, scripted_ar(AFTER, tie=(0.2, [3, 8])), 1e-4)
    assert not clear.passed and "chain: question 1 turn 1: token 2 is 8, AR has 3" in clear.reasons[0]
    other = check_lossless({"ar": ar, "chain": tie}, scripted_ar(AFTER, tie=(1e-6, [3, 5])), 1e-4)
    assert not other.passed  # a tie between two other tokens does not excuse picking a third


def test_lossless_compares_on_past_an_excused_tie():
    """A tie excuses its own token, never the rest of the turn: a divergence after it, from AR re-decoded with the
    chain's tied token, fails (a cache bug often shows first as a near-tie)."""
    ar, after_tie = [record([1, 2, 3, 4], [])], [record([1, 2, 8, 5], [])]
    check = check_lossless({"ar": ar, "chain": after_tie}, scripted_ar(AFTER), 1e-4)
    assert not check.passed and "token 3 is 5, AR has 4" in check.reasons[0]
    assert check.details["near_ties_excused"] == 1


def test_lossless_fails_a_shorter_output():
    check = check_lossless({"ar": [record([1, 2, 3], [])], "c": [record([1, 2], [])]}, scripted_ar(AFTER), 1e-4)
    assert not check.passed and "2 tokens instead of 3" in check.reasons[0]


def test_find_insertions_detects_one_extra_middle_level():
    chains = {"dualistic": ["target", "head"], "polybasic": ["target", "w4", "head"],
              "four": ["target", "w4", "w4-small", "head"], "other": ["target", "ngram"]}
    found = {(f["with"], f["without"], f["level"]) for f in find_insertions(chains)}
    assert found == {("polybasic", "dualistic", "w4"), ("four", "polybasic", "w4-small")}


def test_insertion_uses_measured_values_in_the_paper_columns():
    # Table 1 row 2 (compliant) as measurements in seconds; beta = 1
    without, with_ = summary([0.022, 0.004], [4.34], 1), summary([0.022, 0.007, 0.004], [6.26, 4.67], 1)
    ins = evaluate_insertion({"with": "p", "without": "d", "index": 1, "level": "w4", "between": ["m0", "m1"]},
                             {"p": with_, "d": without}, "both")
    assert ins["values"] == {"T_i": 0.022, "L_i_new": 6.26, "T_new": 0.007, "L_new": 4.67, "T_next": 0.004, "L_i": 4.34,
                             "beta": 1}
    assert ins["theorem_3_2"]["lhs_first"] == pytest.approx(7 / 22)
    assert ins["improves"] and check_insertion([ins]).passed


def test_slow_inserted_level_is_rejected_with_a_reason():
    without, slow = summary([0.05, 0.002], [3.0], 4), summary([0.05, 0.04, 0.002], [3.5, 2.0], 4)
    ins = evaluate_insertion({"with": "p", "without": "d", "index": 1, "level": "w4", "between": ["target", "head"]},
                             {"p": slow, "d": without}, "both")
    assert not ins["improves"] and not ins["direct"]["improves"]
    check = check_insertion([ins])
    assert not check.passed and check.reasons[0].startswith("w4 between target and head does not pay for itself")


def test_insertion_rules_differ_where_the_closed_forms_do():
    # first condition holds, but the drafter's extra rounds make the whole chain slower
    without, with_ = summary([0.02, 0.01], [4.0], 8), summary([0.02, 0.002, 0.01], [8.0, 1.2], 8)
    base = {"with": "p", "without": "d", "index": 1, "level": "x", "between": ["a", "b"]}
    verdicts = {rule: evaluate_insertion(base, {"p": with_, "d": without}, rule)["improves"]
                for rule in ("theorem", "direct", "both")}
    assert verdicts == {"theorem": True, "direct": False, "both": False}


def test_unmeasured_level_fails_insertion_with_the_theory_message():
    without, never = summary([0.05, 0.002], [3.0], 4), summary([0.05, None, 0.002], [3.0, 2.0], 4)
    ins = evaluate_insertion({"with": "p", "without": "d", "index": 1, "level": "w4", "between": ["t", "h"]},
                             {"p": never, "d": without}, "both")
    check = check_insertion([ins])
    assert not check.passed and "T_new is missing" in check.reasons[0]


def result(predicted, measured, speedup=1.0, spread=None):
    """A chain result as decode.evaluation.checks.evaluate_chains makes it: the refined prediction against the
    measured time (`spread`: the error's interval, absent with a single turn)."""
    p = {"time_s": predicted, "error": predicted / measured - 1} | ({"error_interval": spread} if spread else {})
    return {"predictions": {"refined": p, "paper": p}, "decode_time_s": measured, "time_speedup": speedup}


def interval(estimate, low, high):
    return Interval(estimate, low, high, 0.95, 12)


def test_agreement_uses_the_refined_prediction_within_tolerance_and_direction():
    ok = {"d": result(1.05, 1.0), "p": result(0.95, 1.0)}
    check = check_agreement(ok, [], 0.1)
    assert check.passed and check.details == {"prediction": "refined", "tolerance": 0.1}
    off = {"d": result(1.2, 1.0), "p": result(1.0, 1.0)}
    check = check_agreement(off, [], 0.1)
    assert not check.passed and list(check.by_chain) == ["d"]
    assert ("d: the refined prediction predicts 1.20s of decoding, measured 1.00s (+20%, tolerance 10%)"
            in check.reasons[0])
    wrong_way = {"d": result(1.0, 1.0, speedup=2.0), "p": result(1.0, 1.0, speedup=1.9)}
    ins = {"with": "p", "without": "d", "level": "w4", "improves": True,
           "measured_gain": interval(0.95, 0.91, 0.99).as_dict()}
    check = check_agreement(wrong_way, [ins], 0.3)
    assert list(check.by_chain) == ["p"] and "the theory says inserting w4 is faster" in check.reasons[0]
    assert "measured slower than d: 0.95x [0.91, 0.99]: shown slower" in check.reasons[0]
    unresolved = {**ins, "measured_gain": interval(0.95, 0.88, 1.03).as_dict()}  # slower by less than the noise
    assert check_agreement(wrong_way, [unresolved], 0.3).passed
    unknown = {"d": {"predictions": {"refined": {"error_reason": "L_1 is missing"}}, "time_speedup": 1.0}}
    assert "cannot be evaluated (L_1 is missing)" in check_agreement(unknown, [], 0.3).reasons[0]
    paper = check_agreement({"d": result(1.2, 1.0)}, [], 0.1, prediction="paper")
    assert paper.details["prediction"] == "paper" and "Theorem 3.1 predicts 1.20s" in paper.reasons[0]


def test_agreement_fails_only_where_the_errors_interval_clears_the_tolerance():
    noisy = check_agreement({"d": result(1.15, 1.0, spread=[0.05, 0.25])}, [], 0.1)
    assert noisy.passed  # +15%, but the turns' spread reaches inside the tolerance
    shown = check_agreement({"d": result(1.15, 1.0, spread=[0.12, 0.18]), "p": result(0.85, 1.0, spread=[-0.2, -0.11])},
                            [], 0.1)
    assert list(shown.by_chain) == ["d", "p"]
    assert "measured 1.00s (+15% [+12%, +18%], tolerance 10%)" in shown.reasons[0]


CHECKS = [{"name": "lossless", "passed": True, "reasons": [], "by_chain": {}},
          {"name": "insertion", "passed": False, "reasons": ["w4 too slow"],
           "by_chain": {"polybasic": ["w4 too slow"]}},
          {"name": "agreement", "passed": True, "reasons": [], "by_chain": {}}]


def shown(estimate):
    """A speedup clearly above the noise: its interval +-0.1."""
    return interval(estimate, estimate - 0.1, estimate + 0.1)


def test_gate_publishes_the_fastest_admissible_chain_and_lists_the_rejected():
    decision = gate(CHECKS, {"dualistic": shown(1.3), "polybasic": shown(1.8), "dualistic_planned": shown(1.5)})
    assert decision["publish"] and decision["chain"] == "dualistic_planned" and not decision["forced"]
    assert decision["admissible"] == ["dualistic", "dualistic_planned"]
    assert decision["rejected"] == {"polybasic": ["insertion: w4 too slow"]}
    # Holm over the three chains: the strongest is tested at 2.5% / 3, its interval redrawn at 98.3%
    assert ("dualistic_planned, the fastest admissible chain by its interval's lower bound: 1.50x [1.38, 1.63]: "
            "shown faster than AR at 98% confidence.") == decision["explanation"]


def test_gate_ranks_admissible_chains_by_their_lower_bound():
    passing = [{**c, "passed": True, "reasons": [], "by_chain": {}} for c in CHECKS]
    steady, noisy = interval(1.25, 1.18, 1.32), interval(1.40, 1.02, 1.92)  # the higher point, the lower bound
    decision = gate(passing, {"noisy": noisy, "steady": steady})
    assert decision["admissible"] == ["noisy", "steady"] and decision["chain"] == "steady"


def test_gate_never_publishes_a_chain_not_shown_faster_than_ar():
    passing = [{**c, "passed": True, "reasons": [], "by_chain": {}} for c in CHECKS]
    decision = gate(passing, {"dualistic": interval(1.01, 0.96, 1.06), "polybasic": interval(0.9, 0.85, 0.95)})
    assert not decision["publish"] and decision["chain"] is None
    assert decision["explanation"] == ("no chain is shown faster than AR: "
                                       "dualistic 1.01x [0.95, 1.07]: not shown to be faster; "
                                       "polybasic 0.90x [0.84, 0.96]: shown slower (98% intervals).")  # Holm
    assert decision["rejected"]["dualistic"] == ["faster than AR: 1.01x [0.95, 1.07]: not shown to be faster"]
    assert decision["failures"][1].startswith("check failed: faster than AR: "
                                              "polybasic measured 0.90x [0.84, 0.96]: shown slower")
    for choice in ("best", "dualistic"):  # neither force nor the strict gate publishes a chain within the noise
        assert not gate(CHECKS, {"dualistic": interval(1.01, 0.96, 1.06)}, choice, force=True)["publish"]
    single = gate(passing, {"dualistic": interval(1.5, None, None)})  # one turn: no interval, nothing shown
    assert not single["publish"] and "1.50x [no interval: 12 turn(s)]" in single["explanation"]


def test_strict_gate_needs_every_check_and_force_overrides_checks_only():
    strict = gate(CHECKS, {"dualistic": shown(1.3), "polybasic": shown(1.8)}, choice="dualistic")
    assert not strict["publish"] and "a check failed" in strict["explanation"]
    assert strict["failures"] == ["check failed: insertion: w4 too slow"]
    passing = [{**c, "passed": True, "reasons": [], "by_chain": {}} for c in CHECKS]
    assert gate(passing, {"dualistic": shown(1.3), "polybasic": shown(1.8)}, choice="dualistic")["chain"] == "dualistic"
    within_noise = gate(passing, {"dualistic": interval(1.3, 0.99, 1.7), "polybasic": shown(1.8)}, choice="dualistic")
    assert within_noise["explanation"].startswith("eval.publish.chain=dualistic (strict): "
                                                  "it is not shown faster than AR (1.30x")
    forced = gate(CHECKS, {"polybasic": shown(1.8)}, choice="polybasic", force=True)
    assert (forced["publish"] and forced["forced"]
            and "publish.force=true overrode: insertion: w4 too slow" in forced["explanation"])
    best_forced = gate(CHECKS, {"polybasic": shown(1.8)}, force=True)
    assert best_forced["chain"] == "polybasic" and best_forced["decision"] == "published (forced)"


def test_a_refused_publish_sets_the_old_bundle_aside_and_stale_temps_are_removed(tmp_path):
    (tmp_path / "publish").mkdir()
    (tmp_path / "publish" / "chain.json").write_text('{"chain": "old"}')
    (tmp_path / "publish.stale").mkdir()  # an older one is replaced
    for stale in (".publish.tmp-abc", ".publish.old-123", ".eval.tmp-x"):
        (tmp_path / stale).mkdir()
    (tmp_path / ".other").mkdir()
    assert sorted(p.name for p in clean_stale([tmp_path / "eval", tmp_path / "publish"])) == [
        ".eval.tmp-x", ".publish.old-123", ".publish.tmp-abc"]
    assert set_aside(tmp_path / "publish") == tmp_path / "publish.stale"
    assert json.loads((tmp_path / "publish.stale" / "chain.json").read_text()) == {"chain": "old"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other", "publish.stale"]
    assert set_aside(tmp_path / "publish") is None


@pytest.fixture
def bundle_inputs(tmp_path):
    report = tmp_path / "eval"
    report.mkdir()
    (report / "report.json").write_text("{}")
    folders = {}
    for name in ("w4", "head"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "weights.bin").write_bytes(name.encode() * 100)
        folders[name] = folder
    return report, folders


def test_publish_writes_the_whole_bundle(tmp_path, bundle_inputs):
    report, folders = bundle_inputs
    bundle = publish_bundle(tmp_path / "publish", {"chain": "polybasic"}, report, folders)
    assert json.loads((bundle / "chain.json").read_text()) == {"chain": "polybasic"}
    assert (bundle / "report" / "report.json").exists()
    assert folder_hash(bundle / "levels" / "w4") == folder_hash(folders["w4"]) != folder_hash(folders["head"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval", "head", "publish", "w4"]


def test_interrupted_publish_leaves_no_partial_bundle(tmp_path, bundle_inputs, monkeypatch):
    report, folders = bundle_inputs
    previous = publish_bundle(tmp_path / "publish", {"chain": "old"}, report, folders)
    real_copytree, calls = shutil.copytree, []

    def interrupted(src, dst, *args, **kwargs):
        calls.append(src)
        if len(calls) == 3:  # report and w4 copied, then the process is interrupted while copying the head
            raise KeyboardInterrupt
        return real_copytree(src, dst, *args, **kwargs)

    monkeypatch.setattr(shutil, "copytree", interrupted)
    with pytest.raises(KeyboardInterrupt):
        publish_bundle(tmp_path / "publish", {"chain": "new"}, report, folders)
    assert json.loads((previous / "chain.json").read_text()) == {"chain": "old"}  # the last good bundle stays whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval", "head", "publish", "w4"]  # no temp left behind

    shutil.rmtree(previous)
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        publish_bundle(tmp_path / "publish", {"chain": "new"}, report, folders)
    assert not (tmp_path / "publish").exists()


@pytest.mark.parametrize("choice,inserted", [("default", "w4"), ("smoke", "exit12")])
def test_eval_config_composes_and_names_the_insertion(choice, inserted):
    from hydra import compose, initialize

    with initialize(version_base="1.3", config_path="../../conf"):
        cfg = compose("config", overrides=[f"eval={choice}"]).eval
    names = {name: [lvl["name"] for lvl in levels] for name, levels in cfg.chains.items() if levels is not None}
    assert [(i["with"], i["level"]) for i in find_insertions(names)] == [("polybasic", inserted)]
    assert cfg.publish.chain == "best" and cfg.publish.force is False and cfg.confidence == 0.95
    assert cfg.plan.enabled and cfg.checks.agreement_prediction == "refined" and cfg.checks.agreement_tolerance == 0.1


def test_the_eval_rotates_the_methods_order_from_turn_to_turn():
    """As decode.bench does: no method always runs first in a turn (on a cooler cache, or a warmer machine)."""
    from types import SimpleNamespace

    from eval_fixtures import QUESTIONS, ByteTokenizer

    from decode.evaluation.decoding import decode_questions

    calls = []

    def decoder(name):
        def decode(prompt_ids, max_new_tokens):
            calls.append(name)
            return SimpleNamespace(tokens=[1] * max_new_tokens, stats=GenerationStats(1.0, 0.0, 1, 0.0, []))
        return decode

    names = ["ar", "a", "b"]
    records = decode_questions({n: decoder(n) for n in names}, QUESTIONS, ByteTokenizer(), 2, 1)
    turns = sum(len(q.turns) for q in QUESTIONS)
    firsts = calls[len(names)::len(names)]  # after the warm-up, the first method of each turn
    assert len(firsts) == turns >= len(names) and firsts[: len(names)] == names
    assert all(len(r) == turns for r in records.values())
