"""With sampling, a chain's output must be distributed exactly as the target's own sampling.

The first new token comes from the target's prefill alone, so the test looks at new tokens 2 and 3,
which the chain speculates: their exact joint distribution under the target (marginalised over token 1)
is computed from the target's logits, and many chain samples are compared with it by a chi-square test. A deliberately
broken acceptance rule (resampling from p instead of the residual norm(max(0, p - q)) after a rejection) must fail the
same test, which shows the test has the power to catch a biased rule.
"""
from __future__ import annotations

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM
from decode_fixtures import native, noisy_copy, packed, tiny_model
from lossless_fixtures import chi_square_pvalue

import decode.engine.sampling
from decode.engine.chain import Chain
from decode.engine.levels import ModelLevel, NgramLevel
from decode.engine.runner import as_prepared
from decode.engine.sampling import Sampling, probabilities

VOCAB, SAMPLES, PROMPT = 8, 1500, [1, 2, 3, 1, 2]
SAMPLING = Sampling(temperature=1.0, top_k=0, top_p=1.0)
pytestmark = pytest.mark.usefixtures("one_thread")


def exact_joint(target) -> torch.Tensor:
    """P(new tokens 2 and 3) [V, V] under the target's own sampling (its HF forward: a prepared target's model)."""
    target = as_prepared(target).model
    with torch.no_grad():
        p1 = probabilities(target(torch.tensor([PROMPT])).logits[0, -1], SAMPLING)
        p2 = probabilities(target(torch.tensor([PROMPT + [a] for a in range(VOCAB)])).logits[:, -1], SAMPLING)
        pairs = torch.tensor([PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
        p3 = probabilities(target(pairs).logits[:, -1], SAMPLING).view(VOCAB, VOCAB, VOCAB)
    return (p1[:, None, None] * p2[:, :, None] * p3).sum(0)


def chain_counts(chain: Chain) -> torch.Tensor:
    counts = torch.zeros(VOCAB, VOCAB)
    for seed in range(SAMPLES):
        tokens = chain.generate(PROMPT, 3, Sampling(SAMPLING.temperature, seed=seed)).tokens
        counts[tokens[1], tokens[2]] += 1
    return counts


@pytest.fixture(scope="module", params=["eager", "packed", "native"])
def models(request):
    """Eager models, decode.fast's packed ones (the default fast path), and those on the native runner."""
    target = tiny_model(seed=3, vocab=VOCAB, layers=2, hidden=32, init=0.3)
    # drafters that overlap with the target but clearly differ (total variation ~0.3), so that both
    # acceptances and residual resampling happen often
    middle = tiny_model(seed=11, vocab=VOCAB, layers=2, hidden=32, init=0.3)
    trio = target, middle, noisy_copy(middle, 0.5, seed=5)
    if request.param == "native":
        return tuple(native(m) for m in trio)
    return tuple(packed(m) for m in trio) if request.param == "packed" else trio


def draft_vocab_chain(models, draft: dict, method: str = "eagle") -> Chain:
    """target <- EAGLE head (EAGLE-2's or EAGLE-3's: `method`; "eagle int8": EAGLE-2's on int8 rows, where it runs
    natively) that can propose only 4 of the 8 tokens: the others come only from residuals."""
    from decode_fixtures import build_chain
    from heads.eagle import EagleHead
    from heads.eagle3 import Eagle3Head

    method, *weights = method.split()
    levels = [{"kind": "model"}, {"kind": "eagle", "path": "untrained", "method": method, "draft": draft,
               **({"weights": weights[0]} if weights else {})}]
    torch.manual_seed(0)
    head_cls = Eagle3Head if method == "eagle3" else EagleHead
    head = head_cls(as_prepared(models[0]).model, init_std=0.5, draft_vocab=torch.tensor([0, 2, 3, 6]))
    return build_chain(levels, models[0], tokenizer=None, head=head.eval())


def three_level(models) -> Chain:
    target, middle, drafter = models
    return Chain([ModelLevel("target", target), ModelLevel("middle", middle, mu=2),
                  ModelLevel("drafter", drafter, draft={"mode": "chain", "length": 2})])


def restricted_middle(models) -> Chain:
    """target <- middle level whose vocabulary is 5 of the 8 tokens <- drafter."""
    target, middle, drafter = models
    return Chain([ModelLevel("target", target), ModelLevel("middle", middle, mu=2, vocab=torch.tensor([0, 1, 3, 4, 6])),
                  ModelLevel("drafter", drafter, draft={"mode": "chain", "length": 2})])


def test_middle_level_with_restricted_vocabulary_samples_like_the_target(models):
    p = chi_square_pvalue(chain_counts(restricted_middle(models)), exact_joint(models[0]))
    assert p > 1e-3, f"a restricted middle level changed the target's sampling (chi-square p={p:.2e})"


def test_three_level_chain_samples_like_the_target(models):
    p = chi_square_pvalue(chain_counts(three_level(models)), exact_joint(models[0]))
    assert p > 1e-3, f"chain sampling differs from the target's (chi-square p={p:.2e})"


def test_tree_and_prompt_lookup_proposals_sample_like_the_target(models):
    target, middle, drafter = models
    tree = Chain([ModelLevel("target", target),
                  ModelLevel("drafter", drafter, draft={"mode": "tree", "depth": 2, "top_k": 2, "total_tokens": 5})])
    ngram = Chain([ModelLevel("target", target), ModelLevel("middle", middle, mu=2),
                   NgramLevel("lookup", draft={"length": 4})])
    joint = exact_joint(target)
    for chain in (tree, ngram):
        p = chi_square_pvalue(chain_counts(chain), joint)
        assert p > 1e-3, f"{chain.levels[-1].name}: sampling differs from the target's (chi-square p={p:.2e})"


def tiny_sliding(seed: int) -> MistralForCausalLM:
    """A tiny random Mistral whose sliding window (3) is shorter than PROMPT: new tokens 2 and 3 see its end only."""
    torch.manual_seed(seed)
    config = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=3, initializer_range=0.3)
    return MistralForCausalLM(config).eval()


def test_sliding_window_chain_samples_like_the_target():
    """Past a sliding window, a three-level chain whose drafter drafts trees (rollbacks and kept tree paths on the
    levels' windowed runners) samples like the target, whose exact joint its full forward computes."""
    target, middle = tiny_sliding(3), tiny_sliding(11)
    chain = Chain([ModelLevel("target", target), ModelLevel("middle", middle, mu=2),
                   ModelLevel("drafter", noisy_copy(middle, 0.5, seed=5),
                              draft={"mode": "tree", "depth": 2, "top_k": 2, "total_tokens": 5})])
    p = chi_square_pvalue(chain_counts(chain), exact_joint(target))
    assert p > 1e-3, f"past the sliding window, chain sampling differs from the target's (chi-square p={p:.2e})"


@pytest.mark.parametrize("method", ["eagle", "eagle3", "eagle int8"])
def test_draft_vocabulary_chain_samples_like_the_target(models, method):
    joint = exact_joint(models[0])
    for draft in ({"mode": "chain", "length": 2}, {"mode": "tree", "depth": 2, "top_k": 2, "total_tokens": 5}):
        p = chi_square_pvalue(chain_counts(draft_vocab_chain(models, draft, method)), joint)
        assert p > 1e-3, (f"{draft['mode']} drafts over a draft vocabulary: sampling differs from the target's "
                          f"(p={p:.2e})")


@pytest.mark.parametrize("chain", ["three levels", "draft vocabulary", "draft vocabulary, eagle3", "restricted middle"])
def test_broken_acceptance_rule_is_caught(models, monkeypatch, chain):
    monkeypatch.setattr(decode.engine.sampling, "residual", lambda p, q, token: p)  # the classic bug
    method = "eagle3" if chain.endswith("eagle3") else "eagle"
    built = {"three levels": three_level, "restricted middle": restricted_middle}.get(
        chain, lambda m: draft_vocab_chain(m, {"mode": "chain", "length": 2}, method))(models)
    p = chi_square_pvalue(chain_counts(built), exact_joint(models[0]))
    assert p < 1e-3, f"a biased acceptance rule went unnoticed (chi-square p={p:.2e})"


def test_sampling_is_reproducible_per_seed_for_every_level_kind(models):
    from decode_fixtures import build_chain

    target = models[0]
    tree = {"mode": "tree", "depth": 3, "top_k": 2, "total_tokens": 6}
    for levels in ([{"kind": "model"}, {"kind": "model", "model": "target", "layers": 1, "mu": 2},
                    {"kind": "eagle", "path": "untrained", "draft": tree}],
                   [{"kind": "model"}, {"kind": "eagle", "path": "untrained", "draft": {"length": 3}}],
                   [{"kind": "model"}, {"kind": "model", "model": "target", "mu": 2},  # all layers: the aux ones too
                    {"kind": "eagle", "path": "untrained", "method": "eagle3", "draft": tree}]):
        chain = build_chain(levels, target, tokenizer=None)
        runs = [chain.generate(PROMPT, 12, Sampling(0.8, 5, 0.9, seed=s)).tokens for s in (7, 7, 8)]
        assert runs[0] == runs[1] and len(runs[0]) == 12 and all(0 <= t < VOCAB for t in runs[0])
