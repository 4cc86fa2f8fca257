"""The decode engine on CUDA (`device=cuda`): greedy chains equal AR on the same device and dtype, sampling distributed
as the target's. Marked `gpu`; skipped without CUDA (scripts/gpu.sh runs them on a GPU machine)."""
from __future__ import annotations

import copy

import pytest
import torch
from decode_fixtures import noisy_copy, prompts, tiny_model
from lossless_fixtures import greedy_equal
from test_sampling_distribution import SAMPLING, VOCAB as SAMPLING_VOCAB, chain_counts, chi_square_pvalue, exact_joint

from infra.device import resolve_device
from infra.errors import ConfigError
from decode_fixtures import build_chain
from decode.engine.chain import Chain
from decode.engine.levels import ModelLevel

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU (torch.cuda.is_available() is False)")]

VOCAB = 300
TREE = {"mode": "tree", "depth": 4, "top_k": 3, "total_tokens": 10}
CHAINS = {
    "model drafter, chain": [{"kind": "model"},
                             {"kind": "model", "model": "target", "layers": 2, "draft": {"length": 4}}],
    "3 levels, tree, mu 3": [{"kind": "model"}, {"kind": "model", "model": "target", "layers": 3, "mu": 3},
                             {"kind": "model", "model": "target", "layers": 1, "draft": TREE}],
    "eagle chain": [{"kind": "model"}, {"kind": "eagle", "path": "untrained", "draft": {"length": 4}}],
    "eagle tree, nearest features": [{"kind": "model"}, {"kind": "model", "model": "target", "layers": 3, "mu": 2},
                                     {"kind": "eagle", "path": "untrained", "features": "nearest", "draft": TREE}],
    "prompt lookup": [{"kind": "model"}, {"kind": "ngram", "draft": {"length": 5}}],
}


def test_device_resolution_with_cuda(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert resolve_device("auto") == resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match="CUDA device"):
        resolve_device(f"cuda:{torch.cuda.device_count()}")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("shape", CHAINS)
def test_greedy_chain_equals_ar_on_cuda(shape, dtype, tol):
    """Token for token against KV-cached AR of the same target on the same GPU in the same dtype; as on the CPU
    (tests/test_lossless_greedy.py), a divergence passes only at a near-tie of the target's top-2 logits (`tol`,
    relative: bf16 rounds a verification of k tokens differently from k single-token forwards)."""
    target = tiny_model(seed=0, vocab=VOCAB).to("cuda", dtype)
    chain = build_chain(CHAINS[shape], target, tokenizer=None)
    assert all(level.device.type == "cuda" for level in chain.levels if hasattr(level, "device"))
    ties = 0
    for prompt in prompts(VOCAB):
        generation = chain.generate(prompt, 40)
        ok, tie = greedy_equal(target, prompt, generation.tokens, tol)
        assert ok and len(generation.tokens) == 40, (f"{shape} ({dtype}): differs from AR on the same GPU "
                                                     "at a clear margin")
        ties += tie
    assert ties <= 1, f"{shape} ({dtype}): {ties} near-ties in 3 prompts"


@pytest.fixture(scope="module")
def cuda_trio():
    target = tiny_model(seed=3, vocab=SAMPLING_VOCAB, layers=2, hidden=32, init=0.3)
    middle = tiny_model(seed=11, vocab=SAMPLING_VOCAB, layers=2, hidden=32, init=0.3)
    return target, tuple(copy.deepcopy(m).to("cuda") for m in (target, middle, noisy_copy(middle, 0.5, seed=5)))


def test_three_level_chain_samples_like_the_target_on_cuda(cuda_trio):
    """The chi-square test of tests/test_sampling_distribution.py with every level on the GPU (a CUDA generator)."""
    cpu_target, (target, middle, drafter) = cuda_trio
    chain = Chain([ModelLevel("target", target), ModelLevel("middle", middle, mu=2),
                   ModelLevel("drafter", drafter, draft={"mode": "chain", "length": 2})])
    p = chi_square_pvalue(chain_counts(chain), exact_joint(cpu_target))
    assert p > 1e-3, ("chain sampling on CUDA differs from the target's "
                      f"(chi-square p={p:.2e}, T={SAMPLING.temperature})")


