"""The static-cache runner (decode.backends.cuda): on the CPU its eager forward is HFRunner's, forward for forward,
through rollbacks that leave stale keys in the cache, a tree verification kept along one path and captured features;
greedy decoding through it is the target's; sampled chains through it sample like the target. A mask that leaves
rolled-back keys visible must fail the same comparison. The `gpu` tests: graph replay equals the eager forward on
CUDA at every graph width, and greedy decoding through the graphs is CUDA AR's."""
from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from decode_fixtures import noisy_copy, prompts, tiny_model
from lossless_fixtures import greedy_equal

import decode.backends.cuda.runner as static
from decode import backends
from decode.backends.cuda import WIDTHS, StaticRunner, cuda_runners, unsupported
from decode.chains.baselines import autoregressive
from decode.engine.chain import Chain
from decode.engine.errors import DecodeError
from decode.engine.levels import LevelCompute, ModelLevel, NgramLevel
from decode.engine.runner import HFRunner, Prepared
from decode.engine.tree import Tree

VOCAB = 300
TREE = {"mode": "tree", "depth": 4, "top_k": 3, "total_tokens": 10}
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_thread")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (torch.cuda.is_available() is False)")


def sequence(runner, widths: tuple[int, ...] = (5, 3, 1), seed: int = 0) -> list[torch.Tensor]:
    """Every output of a run of forwards: `widths` fed in turn, rolled back twice (re-feeding positions whose stale
    keys stay in a static cache), a tree of 5 nodes verified and kept along one path, then with captured features."""
    gen = torch.Generator().manual_seed(seed)
    outs: list[torch.Tensor] = []

    def feed(n: int, mask=None, positions=None, tokens=None) -> None:
        ids = torch.randint(0, VOCAB, (1, n), generator=gen) if tokens is None else torch.tensor([tokens])
        outs.append(runner.forward(ids.to(runner.device), mask, positions).detach().float())

    for width in widths:
        feed(width)
    runner.crop(runner.cached() - 2)  # two stale positions
    feed(1)
    feed(3)
    runner.crop(4)
    feed(1)
    tree, base = Tree(), runner.cached()
    for token, parent in ((7, -1), (8, -1), (9, 0), (10, 2), (11, 1)):
        tree.add(token, parent)
    feed(5, tree.attention_mask(base, base, runner.dtype, device=runner.device),
         tree.position_ids(base, base, device=runner.device), tree.tokens)
    runner.keep(torch.tensor(list(range(base)) + [base + i for i in (0, 2, 3)], device=runner.device))
    feed(3)
    runner.capture((0, 2))
    feed(1)
    outs.append(runner.captured.detach().float())
    assert runner.cached() == base + 3 + 3 + 1
    return outs


def max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0, vocab=VOCAB)


@pytest.mark.parametrize("widths", [None, ()], ids=["padded to the graph widths", "unpadded"])
def test_the_eager_forward_is_hf_runners_through_rollbacks_trees_and_captures(model, widths):
    assert max_difference(sequence(StaticRunner(model, widths)), sequence(HFRunner(model))) < 1e-5


def leaky_mask(right):
    """The planted bug: `right` (static_mask) leaving the keys past a crop (or a keep) visible."""
    written = [0]

    def leaky(mask, cached, width, span, dtype, rows=None):
        full = right(mask, cached, width, span, dtype, rows)
        full[..., cached + width: written[0]] = 0
        written[0] = max(written[0], cached + width)
        return full

    return leaky


def test_rolled_back_keys_left_visible_are_caught(model, monkeypatch):
    """The planted bug: a mask that leaves the keys past a crop (or a keep) visible."""
    monkeypatch.setattr(static, "static_mask", leaky_mask(static.static_mask))
    assert max_difference(sequence(StaticRunner(model)), sequence(HFRunner(model))) > 1e-3


def configured(model, factory=StaticRunner) -> Prepared:
    """A copy of `model` prepared so that every runner of it is `factory`'s: the AR reference and a chain's levels
    alike (as Backend.prepare does on CUDA)."""
    clone = copy.deepcopy(model)
    return Prepared(clone, functools.partial(factory, clone), clone.get_output_embeddings())


def test_greedy_decoding_through_it_is_the_targets(model):
    static_model = configured(model)
    for prompt in prompts(VOCAB):
        assert autoregressive(static_model, prompt, 40).tokens == autoregressive(model, prompt, 40).tokens


@pytest.mark.parametrize("drafter", ["prompt lookup", "model, chain", "model, tree"])
def test_chains_through_it_are_token_identical_to_ar(model, drafter):
    target, small = configured(model), configured(noisy_copy(model, 0.05, seed=1))
    last = {"prompt lookup": NgramLevel("n", draft={"length": 5}),
            "model, chain": ModelLevel("d", small, draft={"length": 4}),
            "model, tree": ModelLevel("d", small, draft=TREE)}[drafter]
    chain = Chain([ModelLevel("t", target), last])
    assert isinstance(chain.target.runner, StaticRunner)
    accepted = 0
    for prompt in prompts(VOCAB):
        generation = chain.generate(prompt, 40)
        assert generation.tokens == autoregressive(model, prompt, 40).tokens
        accepted += generation.stats.levels[0].accepted
    assert accepted > 0, "the target never accepted a draft: the test exercises no rollback"


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_built_eagle_chains_on_it_are_token_identical_to_ar(model, monkeypatch, method):
    """The builder's chains with every model level on the static runner (as on CUDA): an EAGLE head (EAGLE-3: the
    aux states the runner captures) drafting trees below a middle level that keeps features."""
    from decode_fixtures import build_chain

    monkeypatch.setattr(backends.Backend, "_runner_factory",
                        lambda self, m, compiled: functools.partial(StaticRunner, m))
    levels = [{"kind": "model"}, {"kind": "model", "model": "target", "layers": 3, "mu": 2},
              {"kind": "eagle", "path": "untrained", "method": method, "features": "nearest", "draft": TREE}]
    chain = build_chain(levels, configured(model), tokenizer=None)
    assert all(isinstance(level.runner, StaticRunner) for level in chain.levels[:2])
    for prompt in prompts(VOCAB):
        assert chain.generate(prompt, 30).tokens == autoregressive(model, prompt, 30).tokens


def test_a_sampled_chain_through_it_samples_like_the_target():
    from test_sampling_distribution import VOCAB as V, chain_counts, chi_square_pvalue, exact_joint

    target = tiny_model(seed=3, vocab=V, layers=2, hidden=32, init=0.3)
    middle = tiny_model(seed=11, vocab=V, layers=2, hidden=32, init=0.3)
    levels = [ModelLevel(name, m, compute=LevelCompute(StaticRunner(m)), **kw) for name, m, kw in (
        ("target", target, {}), ("middle", middle, {"mu": 2}),
        ("drafter", noisy_copy(middle, 0.5, seed=5), {"draft": {"mode": "tree", "depth": 2, "top_k": 2,
                                                                 "total_tokens": 5}}))]
    p = chi_square_pvalue(chain_counts(Chain(levels)), exact_joint(target))
    assert p > 1e-3, f"sampling through the static runner differs from the target's (chi-square p={p:.2e})"


def windowed_model(family: str) -> torch.nn.Module:
    """A tiny random model whose sliding window (3) `sequence` passes: Mistral's (every layer, no layer types),
    Qwen2's (its second layer slides, the first attends fully: layer types) or Gemma 2's (alternating, softcapped)."""
    import transformers

    shapes = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, sliding_window=3, initializer_range=0.3)
    torch.manual_seed(0)
    if family == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**shapes)).eval()
    if family == "gemma2":
        config = transformers.Gemma2Config(**shapes, head_dim=8, query_pre_attn_scalar=8, final_logit_softcapping=30.0,
                                           attn_logit_softcapping=50.0)
        return transformers.Gemma2ForCausalLM(config).eval()
    config = transformers.Qwen2Config(**shapes, use_sliding_window=True, max_window_layers=1)
    return transformers.Qwen2ForCausalLM(config).eval()


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma2"])
def test_sliding_windows_mask_by_position_as_hf_runner_does(family):
    """Past the window, through rollbacks and a tree's keep (whose nodes sit at their depth's positions, not their
    slots'), padded or not: the static runner's layer masks are HFRunner's."""
    model = windowed_model(family)
    assert unsupported(model) is None
    reference = sequence(HFRunner(model))
    for widths in (None, ()):
        assert max_difference(sequence(StaticRunner(model, widths)), reference) < 1e-5
    unwindowed = copy.deepcopy(model)  # planted: the window ignored changes what the runner computes
    unwindowed.config.sliding_window = 1000
    assert max_difference(sequence(StaticRunner(unwindowed)), reference) > 1e-3


def test_limits_are_one_line_errors(model):
    runner = StaticRunner(model, max_length=8)
    runner.forward(torch.tensor([[1, 2, 3, 4, 5]]), None, None)
    with pytest.raises(DecodeError, match="holds 8 positions: 5 cached \\+ 4 new do not fit"):
        runner.forward(torch.tensor([[1, 2, 3, 4]]), None, None)
    with pytest.raises(ValueError, match="graph widths \\[1, 16\\] must be between 1 and max_length 8"):
        StaticRunner(model, widths=(1, 16), max_length=8)


def test_models_it_cannot_run_get_hf_runner_with_a_reason(model, capsys):
    dynamic = copy.deepcopy(model)
    dynamic.config.rope_parameters = {**dynamic.config.rope_parameters, "rope_type": "dynamic", "factor": 2.0}
    assert isinstance(cuda_runners(dynamic)(), HFRunner)
    assert "(static runner: dynamic rotary scaling (computed from the sequence))" in capsys.readouterr().err
    chunked = copy.deepcopy(model)
    chunked.config.layer_types, chunked.config.attention_chunk_size = ["chunked_attention", "full_attention"], 8
    assert unsupported(chunked) == ("layer types ['chunked_attention', 'full_attention']: only full and sliding-window "
                                    "attention")
    assert isinstance(cuda_runners(model)(), StaticRunner)
    assert isinstance(backends.Backend().prepare(model).new_runner(), HFRunner)  # on the CPU, as before


def test_the_gpu_check_script_runs_on_the_cpu(tmp_path):
    """scripts/gpu_runner_check.py as a smoke test: a tiny model folder, 16 new tokens; it needs only torch,
    transformers and the project (it asserts so itself on the CPU)."""
    folder = tmp_path / "tiny"
    tiny_model(seed=0, vocab=VOCAB, layers=2).save_pretrained(folder)
    done = subprocess.run([sys.executable, "scripts/gpu_runner_check.py", "--model", str(folder), "--out",
                           str(tmp_path / "out"), "--device", "cpu", "--max-new", "16", "--repeats", "3"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "gpu_runner_check.json").read_text())
    assert report["greedy"]["ar_identical"] and report["greedy"]["chain_identical"], report["greedy"]
    assert report["ms"]["hf_eager_1"] > 0 and report["ms"]["static_eager_1"] > 0
    assert report["forbidden_modules_loaded"] == []


DTYPES = pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])


@pytest.mark.gpu
@needs_cuda
@DTYPES
def test_graph_replay_is_the_eager_forward_at_every_width(model, dtype, tol):
    on_gpu = copy.deepcopy(model).to("cuda", dtype)
    graphs, eager = StaticRunner(on_gpu), StaticRunner(on_gpu, graphs=False)
    captured, capture = [], graphs._capture
    graphs._capture = lambda key, inputs: captured.append(key) or capture(key, inputs)
    difference = max_difference(sequence(graphs, WIDTHS), sequence(eager, WIDTHS))
    assert difference <= tol / 10, f"graph replay differs from the eager forward by {difference:.3g} ({dtype})"
    assert {ids[1] for ids, *_ in captured} == set(WIDTHS), captured  # keyed by the inputs' shapes, ids' first


@pytest.mark.gpu
@needs_cuda
@DTYPES
def test_greedy_decoding_through_the_graphs_is_cuda_ars(model, dtype, tol):
    """Against AR on HFRunner on the same GPU in the same dtype, and the chain the builder makes there (its target on
    the static runner); a divergence passes only at a near-tie of the target's top-2 logits (decode_fixtures)."""
    from decode_fixtures import build_chain

    on_gpu = copy.deepcopy(model).to("cuda", dtype)
    prepared = backends.Backend().prepare(on_gpu)  # CUDA: the static runner
    chain = build_chain([{"kind": "model"}, {"kind": "ngram", "draft": {"length": 5}}], prepared, tokenizer=None)
    assert isinstance(chain.target.runner, StaticRunner)
    ties = 0
    for prompt in prompts(VOCAB):
        for tokens in (autoregressive(prepared, prompt, 40).tokens, chain.generate(prompt, 40).tokens):
            ok, tie = greedy_equal(on_gpu, prompt, tokens, tol)
            assert ok and len(tokens) == 40, f"differs from CUDA AR at a clear margin ({dtype})"
            ties += tie
    assert ties <= 2, f"{ties} near-ties in 3 prompts, 2 decoders ({dtype})"
