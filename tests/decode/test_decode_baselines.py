"""The baselines share the chain's result type, and greedy they all reproduce the target's output."""
from __future__ import annotations

import pytest
import torch
from decode_fixtures import noisy_copy, prompts, tiny_model

from decode.chains.baselines import autoregressive, hf_assisted, hf_prompt_lookup
from decode.engine.levels import Generation
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models():
    target = tiny_model(seed=0, vocab=300)
    return target, noisy_copy(target, 0.03, seed=1)


def test_autoregressive_matches_uncached_argmax(models):
    target, _ = models
    prompt = prompts(300, n=1)[0]
    generation = autoregressive(target, prompt, 12)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(target(torch.tensor([ids])).logits[0, -1].argmax()))
    assert generation.tokens == ids[len(prompt):]
    stats = generation.stats
    assert stats.new_tokens == 12 and stats.levels[0].forward_calls == 11  # the prefill is time_to_first_token_s
    assert 0 < stats.time_to_first_token_s <= stats.wall_time_s and stats.tokens_per_s > 0


def test_hf_baselines_return_generations_equal_to_ar(models):
    target, assistant = models
    for prompt in prompts(300, n=2):
        reference = autoregressive(target, prompt, 16).tokens
        for generation in (hf_assisted(target, assistant, prompt, 16), hf_prompt_lookup(target, prompt, 16, 4)):
            assert isinstance(generation, Generation)
            assert generation.tokens == reference
            assert generation.stats.time_to_first_token_s > 0


def test_eos_truncates_every_baseline(models):
    target, assistant = models
    prompt = prompts(300, n=1)[0]
    reference = autoregressive(target, prompt, 16).tokens
    eos = reference[5]
    expected = reference[: reference.index(eos) + 1]
    assert autoregressive(target, prompt, 16, eos_token_id=eos).tokens == expected
    assert hf_prompt_lookup(target, prompt, 16, 4, eos_token_id=eos).tokens == expected
