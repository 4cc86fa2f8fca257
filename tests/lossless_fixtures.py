"""The checks that decoding is lossless, shared by tests/decode and the pipeline test (not a test module): greedy
token identity to AR with near-ties excused, each middle level's consistency with itself, and a chi-square p-value
for sampled tokens against exact probabilities."""
from __future__ import annotations

import torch
from transformers import PreTrainedModel

from decode.chains.baselines import autoregressive
from decode.engine.chain import Chain
from decode.engine.runner import Prepared


def greedy_equal(target, prompt: list[int], got: list[int], tol: float = 1e-4,
                 ref: list[int] | None = None) -> tuple[bool, int]:
    """Compare a chain's greedy tokens with the target's plain greedy decoding (`ref`, e.g. transformers' `generate`;
    None: KV-cached AR), as the eval does (decode.evaluation.checks.compare_greedy): a divergence passes only at a
    near-tie of the target's top-2 logits in the forward that chose AR's token (relative margin within tol), and the
    comparison goes on past it against AR re-decoded with the chain's token. Returns (ok, ties seen). Both are looked
    up when called, as the eval does, so that a planted bug in either reaches this check too."""
    from decode.chains.baselines import greedy_margins
    from decode.evaluation.checks import compare_greedy

    ref = autoregressive(target, prompt, len(got)).tokens if ref is None else ref
    reason, ties = compare_greedy(prompt, got, ref, lambda p, forced, n: greedy_margins(target, p, forced, n), tol)
    return reason is None, len(ties)


Block = tuple[int, list[int], list[int]]  # (middle level's index, the context it proposed after, the tokens)


def handed_up(chain: Chain) -> list[Block]:
    """From now on, every block of tokens a middle level of `chain` hands up to the level above, as it hands it up
    (a spy on the chain's own proposal path, Chain._propose)."""
    blocks: list[Block] = []
    propose, last = chain._propose, len(chain.levels) - 1

    def spy(i, ctx, *rest):
        proposal = propose(i, ctx, *rest)
        if 0 < i < last and proposal.tokens:
            blocks.append((i, list(ctx), list(proposal.tokens)))
        return proposal

    chain._propose = spy
    return blocks


def self_consistent(blocks: list[Block], models: dict[int, Prepared | PreTrainedModel]) -> bool:
    """With greedy decoding a middle level is lossless with respect to itself: every block it hands up is its own
    greedy continuation of the context (greedy_equal with that level's model, `models[i]`, as the target). The
    target's check cannot see a middle level's error, which the target corrects; this check does."""
    return all(greedy_equal(models[i], ctx, tokens)[0] for i, ctx, tokens in blocks)


def chi_square_pvalue(counts: torch.Tensor, expected_p: torch.Tensor) -> float:
    """Pearson chi-square against exact probabilities; cells with expected count < 5 are pooled."""
    expected = expected_p.flatten().double() * counts.sum()
    counts = counts.flatten().double()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]]) if small.any() else counts
    exp = torch.cat([expected[~small], expected[small].sum()[None]]) if small.any() else expected
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))
