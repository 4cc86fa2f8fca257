"""decode.evaluation.measure: the per-level summary and both predictions (Theorem 3.1, refined) that decode.bench and
decode.eval share, on synthetic engine stats; and the same numbers printed by both."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from decode.evaluation import measure
from decode.settings import CheckSettings
from decode.engine.levels import Generation, GenerationStats, LevelStats


def _two_level(new_tokens: int, wall: float, ttft: float) -> Generation:
    # target: 4 verifications of 50 ms accepting 4 tokens each; drafter: 12 forwards of 10 ms (beta = 3)
    target = LevelStats("target", "model", forward_calls=4, verify_time_s=0.2, acceptance_lengths=[4, 4, 4, 4],
                        proposed=12, accepted=12)
    drafter = LevelStats("draft", "model", forward_calls=12, draft_time_s=0.12)
    return Generation(list(range(new_tokens)), GenerationStats(wall, ttft, new_tokens, 3.0, [target, drafter]))


def _three_level(new_tokens: int = 17, wall: float = 1.3, ttft: float = 0.1) -> Generation:
    # 16 tokens after the first: the target verifies 4 hand-ups of 6 tokens (keeps 3 + its own: L_1 = 4);
    # the middle level made 24 tokens at L_2 = 2: 12 rounds; the drafter 3 forwards a middle round: 36.
    target = LevelStats("target", "model", "CompiledRunner", forward_calls=4, verify_time_s=0.4,
                        acceptance_lengths=[4] * 4, proposed=24, accepted=12, forwards=[(7, 0.1)] * 4)
    middle = LevelStats("w4", "model", "NativeLlamaRunner", forward_calls=12, verify_time_s=0.48,
                        acceptance_lengths=[2] * 12, proposed=36, accepted=12, forwards=[(4, 0.04)] * 12)
    drafter = LevelStats("head", "eagle", forward_calls=36, draft_time_s=0.36, forwards=[(1, 0.01)] * 36)
    return Generation(list(range(new_tokens)), GenerationStats(wall, ttft, new_tokens, 3.0, [target, middle, drafter]))


def test_both_predictions_match_a_two_level_run_that_follows_the_theorem():
    # N = 16 decoded tokens after the first: 16/4 * 50 ms + 3 * 16/4 * 10 ms = 0.32 s
    s = measure.summarize([_two_level(17, wall=0.42, ttft=0.1).stats])
    assert s["decode_tokens"] == 16 and s["decode_time_s"] == pytest.approx(0.32)
    for kind in ("paper", "refined"):
        assert s["predictions"][kind]["time_s"] == pytest.approx(0.32)
        assert s["predictions"][kind]["error"] == pytest.approx(0.0, abs=1e-9)


def test_engine_overhead_shows_as_prediction_error():
    s = measure.summarize([_two_level(17, wall=0.5, ttft=0.1).stats])  # 80 ms the theory does not see
    assert s["predictions"]["refined"]["error"] == pytest.approx(0.32 / 0.4 - 1)


def test_three_levels_refined_counts_what_the_middle_level_hands_up():
    s = measure.summarize([_three_level().stats])
    target, middle, head = s["levels"]
    assert middle["handed_up"] == pytest.approx(6) and "handed_up" not in target and "handed_up" not in head
    assert target["tokens_per_forward"] == 7 and s["draft_depth"] == pytest.approx(3)
    # refined: 4 * 100 ms + 4 * 6/2 = 12 rounds * 40 ms + 36 * 10 ms = 1.24 s, all of the forward time
    assert s["predictions"]["refined"]["time_s"] == pytest.approx(1.24)
    assert s["predictions"]["refined"]["error"] == pytest.approx(1.24 / 1.2 - 1)
    # Theorem 3.1: 16/4 * 100 ms + 16/2 * 40 ms + 3 * 16/2 * 10 ms = 0.96 s: it misses the discarded work
    assert s["predictions"]["paper"]["time_s"] == pytest.approx(0.96)


def test_bench_and_eval_print_the_same_per_level_numbers_for_the_same_generations(tmp_path):
    from decode.bench import summarise, table
    from decode.evaluation.checks import evaluate_chains
    from decode.evaluation.decoding import Decoded, Record
    from decode.publish.bundle import gate
    from decode.evaluation.report import markdown
    from decode.evaluation.speedup import Interval

    target = LevelStats("target", "model", forward_calls=16, verify_time_s=1.6)
    ar = [Generation(list(range(17)), GenerationStats(1.7, 0.1, 17, 0.0, [target])) for _ in range(2)]
    chain = [_three_level(wall=1.3), _three_level(wall=1.4)]
    bench = summarise({"ar": ar, "polybasic": chain}, [g.tokens for g in ar], 0.95)
    printed = table(bench, {"polybasic": "polybasic"})

    records = {name: [Record(i, "qa", 0, [1, 2], g.tokens, g.stats) for i, g in enumerate(gens)]
               for name, gens in (("ar", ar), ("polybasic", chain))}
    checks = CheckSettings({"float32": 1e-4}, "both", 0.1, confidence=0.95)
    levels = [{"name": name} for name in ("target", "w4", "head")]
    report = evaluate_chains(Decoded(records, {"polybasic": levels}, 2), lambda ids: (1.0, [0, 0]), checks, 1e-4)
    speedups = {n: Interval.from_dict(r["time_speedup_interval"]) for n, r in report["chains"].items()}
    report |= {"run_name": "t", "gate": gate(report["checks"], speedups),
               "config": {"theorem_3_3": {"temperature": 1.0}, "confidence": 0.95}}
    md = markdown(report)

    line = measure.level_line(report["summaries"]["polybasic"])
    assert line == "target (CompiledRunner): T=100ms L=4.00, w4 (NativeLlamaRunner): T=40ms L=2.00 P=6.00, head: T=10ms"
    assert line in printed and line in md
    assert measure.prediction_line(bench["polybasic"]["measured"]) in printed
    assert measure.prediction_line(report["summaries"]["polybasic"]) in md
    assert bench["polybasic"]["measured"]["predictions"] == report["summaries"]["polybasic"]["predictions"]
    interval = report["chains"]["polybasic"]["time_speedup_interval"]  # and the same speedup interval
    assert bench["polybasic"]["time_speedup_interval"] == interval and Interval.from_dict(interval).text() in printed
    assert interval["text"] in md


def test_bench_skips_the_assistant_and_chain_slots_set_to_null(monkeypatch):
    """decode.bench.assistant=null (or a chain slot = null) leaves that method out instead of failing."""
    from types import SimpleNamespace

    import data.models
    from decode.bench import methods
    from decode.settings import bench_of
    from decode.engine.runner import as_prepared
    from decode_fixtures import tiny_model

    target = tiny_model()
    monkeypatch.setattr(data.models, "load_model", lambda *args, **kwargs: (target, None))
    cfg = OmegaConf.create({
        "run_dir": "runs/unused", "model": {"name": "tiny", "dtype": "float32"},
        "decode": {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0, "fast": False,
                   "bench": {"assistant": None, "two_level": None, "three_level": None, "extra": [],
                             "prompt_lookup_num_tokens": 3}}})
    found, notes = methods(bench_of(cfg), as_prepared(target), SimpleNamespace(eos_token_id=None))
    assert list(found) == list(notes) == ["ar", "hf_prompt_lookup"]  # decode.fast off: no separate eager row
    assert len(found["ar"]([1, 2, 3], 4).tokens) == 4
