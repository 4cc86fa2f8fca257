"""The benchmark's Theorem 3.1 column: predicted decoding time from the run's own T_i, L_i and β."""
from __future__ import annotations

import pytest

from decode.bench import theorem_3_1
from decode.chain import Generation, GenerationStats, LevelStats


def _generation(new_tokens: int, wall: float, ttft: float) -> Generation:
    # target: 4 verifications of 50 ms accepting 4 tokens each; drafter: 12 forwards of 10 ms (β = 3)
    target = LevelStats("target", "model", forward_calls=4, verify_time_s=0.2, acceptance_lengths=[4, 4, 4, 4])
    drafter = LevelStats("draft", "model", forward_calls=12, draft_time_s=0.12)
    return Generation(list(range(new_tokens)), GenerationStats(wall, ttft, new_tokens, 3.0, [target, drafter]))


def test_prediction_matches_a_run_that_follows_the_theorem():
    # N = 16 decoded tokens after the first: 16/4 * 50 ms + 3 * 16/4 * 10 ms = 0.32 s
    result = theorem_3_1([_generation(17, wall=0.42, ttft=0.1)])
    assert result["predicted_decode_s"] == pytest.approx(0.32)
    assert result["measured_decode_s"] == pytest.approx(0.32)
    assert result["prediction_error"] == pytest.approx(0.0, abs=1e-9)


def test_engine_overhead_shows_as_prediction_error():
    result = theorem_3_1([_generation(17, wall=0.5, ttft=0.1)])  # 80 ms the theorem does not see
    assert result["prediction_error"] == pytest.approx(0.32 / 0.4 - 1)
