"""Every family polyspec promises (tests/family_models.py) decodes exactly, past its sliding window where it has one:
each chain kind's greedy output equals transformers' own `generate` on the same model (near-ties excused by the
suite's rule, lossless_fixtures.greedy_equal), with the target prepared as the apps prepare it under
`decode.backend=eager`; and each family runs where it should: the native CPU runner, or transformers' forward with the
reason said in one line. Under `auto` (slow: AOTInductor compiles) every family the native runner does not run runs
the compiled runner, ahead of time, and decodes exactly on it."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from decode_fixtures import build_chain, noisy_copy
from family_models import FAMILIES, WINDOW, tiny_family_model
from lossless_fixtures import greedy_equal

from data.models import load_model
from decode.backends import Backend, runs_natively
from decode.backends.cpu.llama import native_fp32_runner, native_kernels
from decode.engine.runner import HFRunner, Prepared
from infra.layout import RunLayout

NEW_TOKENS = 100
SLIDING = {"qwen2", "mistral", "gemma2", "gemma3", "gpt_oss"}
# Why each family does not run on the native CPU runner (None: it does, where the kernels build).
NATIVE_PROBLEM = {
    "llama": None, "llama3": None, "qwen2": "sliding-window attention", "qwen3": "architecture 'qwen3'",
    "mistral": "sliding-window attention", "gemma2": "architecture 'gemma2'", "gemma3": "architecture 'gemma3_text'",
    "phi3": "architecture 'phi3'", "mixtral": "architecture 'mixtral'", "qwen3_moe": "architecture 'qwen3_moe'",
    "gpt_oss": "architecture 'gpt_oss'", "gpt_neox": "not a transformers decoder-only model",
}
TREE = {"mode": "tree", "depth": 3, "top_k": 3, "total_tokens": 8}
NOISY = "noisy"  # a folder beside the target's: the target with noise on its weights, a drafter that often agrees
# Chains as conf/decode/chain.yaml writes them: a stand-in is an early-exit copy of the target, the heads untrained
# (they rarely agree, but every verification keeps a tree's path); the noisy copy makes rollbacks of every length.
CHAINS = {
    "lookup": [{"kind": "model"}, {"kind": "ngram", "max_ngram": 3, "draft": {"length": 6}}],
    "standin chain": [{"kind": "model"}, {"kind": "model", "model": "target", "layers": 1, "draft": {"length": 4}}],
    "model chain": [{"kind": "model"}, {"kind": "model", "model": NOISY, "draft": {"length": 4}}],
    "model tree": [{"kind": "model"}, {"kind": "model", "model": NOISY, "draft": TREE}],
    "dualistic tree": [{"kind": "model"}, {"kind": "eagle", "path": "untrained", "draft": TREE}],
    "eagle3 tree": [{"kind": "model"}, {"kind": "eagle", "path": "untrained", "method": "eagle3", "draft": TREE}],
    "polybasic tree": [{"kind": "model"}, {"kind": "model", "model": NOISY, "mu": 2},
                       {"kind": "eagle", "path": "untrained", "draft": TREE}],
}
pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass(frozen=True)
class Family:
    name: str
    root: Path  # the target's folder and the noisy copy's
    target: Prepared  # as the apps prepare it: packed, on the native runner where it runs
    tokenizer: object
    prompt: list[int]
    reference: list[int]  # transformers' greedy `generate` on the plain model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> Family:
    """A family's tiny model, a 44-token prompt (far past the window of 16; repeats give prompt lookup something to
    find) and transformers' greedy continuation of it."""
    root = tmp_path_factory.mktemp(request.param)
    folder = tiny_family_model(request.param, root / "target")
    model, tokenizer = load_model(str(folder))
    noisy_copy(model, 0.03).save_pretrained(root / NOISY)
    tokenizer.save_pretrained(root / NOISY)
    body = torch.randint(0, model.config.vocab_size, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    prompt = body + body[:4] + body
    assert len(prompt) > 2 * WINDOW
    with torch.no_grad():
        reference = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    target = Backend("auto", native_fp32="auto", runner="eager").prepare(copy.deepcopy(model))
    return Family(request.param, root, target, tokenizer, prompt, reference[0, len(prompt):].tolist())


def test_each_family_runs_where_it_should(family, capsys):
    """Llama's run on the native runner; every other family on transformers' forward, saying why in one line; the
    sliding-window ones apply their window in the mask (a cache that keeps every key: HFRunner.windows)."""
    problem = NATIVE_PROBLEM[family.name]
    assert runs_natively(family.target) == (problem is None and native_kernels()[0] is not None)
    if problem is None:
        return
    runner = family.target.new_runner()
    assert isinstance(runner, HFRunner) and (runner.windows is not None) == (family.name in SLIDING)
    assert native_fp32_runner(family.target.model, "auto") is None
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and problem in said[0], said


def test_autoregressive_reference_equals_transformers_generate(family):
    """The apps' AR reference (the prepared target's runner, one token a forward) is transformers' own decoding."""
    from decode.chains.baselines import autoregressive

    tokens = autoregressive(family.target, family.prompt, NEW_TOKENS, eos_token_id=family.tokenizer.eos_token_id)
    assert greedy_equal(family.target, family.prompt, tokens.tokens, ref=family.reference) == (True, 0)


@pytest.mark.parametrize("chain", CHAINS)
def test_chain_greedy_equals_transformers_generate(family, chain):
    torch.manual_seed(0)  # the untrained heads' weights
    built = build_chain(CHAINS[chain], family.target, family.tokenizer, RunLayout(family.root))
    generation = built.generate(family.prompt, NEW_TOKENS, eos_token_id=family.tokenizer.eos_token_id)
    ok, ties = greedy_equal(family.target, family.prompt, generation.tokens, ref=family.reference)
    assert ok, f"{family.name}, {chain}: the output differs from transformers' generate at a clear margin"
    assert ties <= 1, f"{family.name}, {chain}: {ties} near-ties; fp32 tiny models should almost never tie"
    if NOISY in str(CHAINS[chain]):  # the noisy copy's drafts are accepted in part: rollbacks and kept tree paths
        assert 0 < generation.stats.levels[0].accepted < generation.stats.levels[0].proposed, generation.stats.levels


@pytest.mark.slow
def test_under_auto_each_family_the_native_runner_refuses_decodes_exactly_ahead_of_time_compiled(family, capsys):
    """A model tree drafted by the noisy copy (rollbacks and kept tree paths), both levels on the compiled runner
    compiled by AOTInductor (the copy's libraries loaded from disk: the same shapes), saying why in one line each."""
    from decode.backends.static import CompiledRunner

    target = Backend("auto", native_fp32="auto").prepare(load_model(str(family.root / "target"))[0])
    if NATIVE_PROBLEM[family.name] is None:
        assert runs_natively(target) == (native_kernels()[0] is not None)
        return
    assert target.new_runner.func is CompiledRunner and target.new_runner.keywords == {"backend": "aoti"}
    built = build_chain(CHAINS["model tree"], target, family.tokenizer, RunLayout(family.root), gemm="auto")
    assert all(isinstance(level.runner, CompiledRunner) for level in built.levels)
    generation = built.generate(family.prompt, NEW_TOKENS, eos_token_id=family.tokenizer.eos_token_id)
    assert greedy_equal(target, family.prompt, generation.tokens, ref=family.reference)[0], family.name
    assert 0 < generation.stats.levels[0].accepted < generation.stats.levels[0].proposed, generation.stats.levels
    said = [line for line in capsys.readouterr().err.splitlines() if "compiled runner" in line]
    assert len(said) == 2 and all(NATIVE_PROBLEM[family.name] in line for line in said), said
