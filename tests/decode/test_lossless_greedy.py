"""Greedy output of every chain shape must be token-identical to the target's plain greedy decoding.

A divergence only passes at a numerical near-tie of the target's own top-2 logits (see
decode_fixtures.greedy_equal); ties are counted and reported, and must stay rare.
"""
from __future__ import annotations

import pytest
import torch
from decode_fixtures import native, noisy_copy, packed, prompts, tiny_model
from lossless_fixtures import greedy_equal, handed_up, self_consistent

from decode_fixtures import build_chain
from decode.engine.chain import Chain
from decode.engine.levels import EagleLevel, ModelLevel, NgramLevel
from decode.backends import runs_natively
from decode.engine.runner import as_prepared

VOCAB = 300
TREE = {"mode": "tree", "depth": 4, "top_k": 3, "total_tokens": 10}
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["eager", "auto", "onednn", "native"])
def models(request):
    """Every test runs on plain eager models and on decode.fast's packed ones: the default fast path (auto: the
    AVX2 kernel where it builds), oneDNN's packed product, and the native runner (decode.native_fp32: every model
    level, the target and its AR reference included, one C++ call per forward)."""
    target = tiny_model(seed=0, vocab=VOCAB)
    # a close copy (agrees often) and a rough one (agrees sometimes): acceptance paths of every length
    trio = target, noisy_copy(target, 0.03, seed=1), noisy_copy(target, 0.1, seed=2)
    if request.param == "native":
        return tuple(native(m) for m in trio)
    return trio if request.param == "eager" else tuple(packed(m, request.param) for m in trio)


SHAPES = {
    "2 levels, model drafter, chain": lambda t, m, d: [ModelLevel("t", t), ModelLevel("d", m, draft={"length": 4})],
    "2 levels, model drafter, tree": lambda t, m, d: [ModelLevel("t", t), ModelLevel("d", d, draft=TREE)],
    "2 levels, prompt lookup": lambda t, m, d: [ModelLevel("t", t), NgramLevel("n", draft={"length": 5})],
    "3 levels, mu 1": lambda t, m, d: [ModelLevel("t", t), ModelLevel("m", m), ModelLevel("d", d, draft={"length": 3})],
    "3 levels, mu 4": lambda t, m, d: [ModelLevel("t", t), ModelLevel("m", m, mu=4),
                                       ModelLevel("d", d, draft={"length": 3})],
    "3 levels, tree, mu 3": lambda t, m, d: [ModelLevel("t", t), ModelLevel("m", m, mu=3),
                                             ModelLevel("d", d, draft=TREE)],
    "4 levels, mu 4/2": lambda t, m, d: [ModelLevel("t", t), ModelLevel("m", m, mu=4), ModelLevel("m2", d, mu=2),
                                         NgramLevel("n", draft={"length": 3})],
    "4 levels, tree": lambda t, m, d: [ModelLevel("t", t), ModelLevel("m", m, mu=2), ModelLevel("m2", d, mu=1),
                                       ModelLevel("d", noisy_copy(t, 0.2, seed=3), draft=TREE)],
}


@pytest.mark.parametrize("off", [-1, 1])
def test_a_rollback_off_by_one_in_the_native_runner_is_caught_not_excused(monkeypatch, off):
    """Planted: the native runner's rollback crops to length - 1 (loses an accepted token's keys) or length + 1
    (keeps a rejected one's). The chain's output then parts from AR's, and greedy_equal fails it: not excused as a
    near-tie, and not hidden behind one, since the comparison goes on past an excused tie."""
    from decode.backends.cpu.llama import NativeLlamaRunner

    target = tiny_model(seed=0, vocab=VOCAB)
    t, m, d = (native(x) for x in (target, noisy_copy(target, 0.03, seed=1), noisy_copy(target, 0.1, seed=2)))
    crop = NativeLlamaRunner.crop

    def planted(self, length: int) -> None:
        crop(self, length + off if length < self.length else length)

    chain = Chain(SHAPES["3 levels, mu 4"](t, m, d))
    monkeypatch.setattr(NativeLlamaRunner, "crop", planted)
    outputs = [(prompt, chain.generate(prompt, 40).tokens) for prompt in prompts(VOCAB)]
    monkeypatch.undo()
    assert not all(greedy_equal(t, prompt, tokens)[0] for prompt, tokens in outputs)


def clear_margin_swap(target) -> tuple[list[int], list[int], float]:
    """(prompt, tokens, margin): AR's greedy tokens with one swapped for the target's runner-up where its relative
    top-2 margin is clear (> 1e-2, 100x the tolerance), then AR's own continuation of that swap."""
    from decode.chains.baselines import greedy_margins

    prompt = prompts(VOCAB, 1, seed=13)[0]
    tokens, margins = greedy_margins(target, prompt, [], 24)
    pos = next(i for i, (margin, _) in enumerate(margins) if margin > 1e-2)
    margin, (_, runner_up) = margins[pos]
    return prompt, greedy_margins(target, prompt, tokens[:pos] + [runner_up], 24)[0], margin


def assert_no_near_tie(target, prompt: list[int], swapped: list[int], margin: float) -> None:
    """greedy_equal fails a swap at a clear margin; with a tolerance above that margin it excuses the same swap as
    one tie and the rest compares equal: the excuse turns on the margin AR's forward saw, nothing else."""
    assert greedy_equal(target, prompt, swapped) == (False, 0), f"a divergence at margin {margin:.2e} was excused"
    assert greedy_equal(target, prompt, swapped, tol=2 * margin) == (True, 1)


def test_greedy_equal_fails_a_divergence_at_a_clear_margin(models):
    assert_no_near_tie(models[0], *clear_margin_swap(models[0]))


def test_a_near_tie_excuse_applied_to_a_clear_margin_is_caught(monkeypatch):
    """Planted: greedy_margins reports every top-2 margin a million times too small (a margin in the wrong units),
    so the lossless check takes any divergence at the target's top-2 for a near-tie. The suite's check,
    assert_no_near_tie (test_greedy_equal_fails_a_divergence_at_a_clear_margin), fails."""
    from decode.chains import baselines

    target = native(tiny_model(seed=0, vocab=VOCAB))
    swap = clear_margin_swap(target)
    margins = baselines.greedy_margins

    def planted(*args, **kwargs):
        tokens, found = margins(*args, **kwargs)
        return tokens, [(margin * 1e-6, top2) for margin, top2 in found]

    monkeypatch.setattr(baselines, "greedy_margins", planted)
    with pytest.raises(AssertionError, match="was excused"):
        assert_no_near_tie(target, *swap)


@pytest.mark.parametrize("shape", SHAPES)
def test_chain_greedy_equals_target_greedy(models, shape):
    """The output is the target's; and every middle level hands up only its own greedy tokens (self_consistent),
    which the target's check cannot see: the target corrects a middle level's wrong proposal."""
    target = models[0]
    chain = Chain(SHAPES[shape](*models))
    blocks = handed_up(chain)
    ties, accepted = 0, 0
    for prompt in prompts(VOCAB):
        generation = chain.generate(prompt, 40)
        ok, tie = greedy_equal(target, prompt, generation.tokens)
        assert ok, f"{shape}: output differs from the target's greedy decoding at a clear margin"
        ties += tie
        accepted += generation.stats.levels[0].accepted
        assert len(generation.tokens) == 40
    assert ties <= 1, f"{shape}: {ties} near-ties in 3 prompts; fp32 tiny models should almost never tie"
    assert accepted > 0, f"{shape}: the target never accepted a proposed token; the test exercises nothing"
    if len(chain.levels) > 2:  # in every shape the middle levels run models[1], then models[2]
        assert blocks and self_consistent(blocks, {1: models[1], 2: models[2]}), (
            f"{shape}: a middle level handed up tokens that are not its own greedy continuation")


def test_a_middle_level_handing_up_one_token_too_many_is_caught(monkeypatch):
    """Planted: a middle level hands up, after the tokens it verified, one more: the next token the level below
    drafts, unverified. The target rejects what is wrong in it, so the output stays the target's and greedy_equal
    passes; the middle level's own check, self_consistent (in test_chain_greedy_equals_target_greedy), fails."""
    target = tiny_model(seed=0, vocab=VOCAB)
    t, m, d = (native(x) for x in (target, noisy_copy(target, 0.03, seed=1), noisy_copy(target, 0.1, seed=2)))
    propose = Chain._propose

    def planted(self, i, ctx, stop, eos, sampling, gen):
        proposal = propose(self, i, ctx, stop, eos, sampling, gen)
        if 0 < i < len(self.levels) - 1:
            proposal.tokens.extend(propose(self, i + 1, ctx + proposal.tokens, stop, eos, sampling, gen).tokens[:1])
        return proposal

    chain = Chain(SHAPES["3 levels, mu 4"](t, m, d))
    monkeypatch.setattr(Chain, "_propose", planted)
    blocks = handed_up(chain)
    outputs = [(prompt, chain.generate(prompt, 40).tokens) for prompt in prompts(VOCAB)]
    monkeypatch.undo()
    assert all(greedy_equal(t, prompt, tokens)[0] for prompt, tokens in outputs)
    assert not self_consistent(blocks, {1: m})


EAGLE = {
    "2 levels, eagle chain": [{"kind": "model"}, {"kind": "eagle", "path": "untrained", "draft": {"length": 4}}],
    "2 levels, eagle tree": [{"kind": "model"}, {"kind": "eagle", "path": "untrained", "draft": TREE}],
    "3 levels, eagle tree, nearest features": [
        {"kind": "model"}, {"kind": "model", "model": "target", "layers": 3, "mu": 3},
        {"kind": "eagle", "path": "untrained", "features": "nearest", "draft": TREE}],
    "3 levels, eagle chain, target features": [
        {"kind": "model"}, {"kind": "model", "model": "target", "layers": 3, "mu": 2},
        {"kind": "eagle", "path": "untrained", "features": "target", "draft": {"length": 3}}],
    "2 levels, eagle tree, int8 head": [{"kind": "model"},
                                        {"kind": "eagle", "path": "untrained", "weights": "int8", "draft": TREE}],
    "3 levels, eagle chain, int8 head": [
        {"kind": "model"}, {"kind": "model", "model": "target", "layers": 3, "mu": 2},
        {"kind": "eagle", "path": "untrained", "weights": "int8", "draft": {"length": 3}}],
}


# the same shapes with an EAGLE-3 head (aux states handed down; int8 rows are an EAGLE-2 head's)
EAGLE.update({f"{shape}, eagle3": [{**lv, "method": "eagle3"} if lv["kind"] == "eagle" else lv for lv in chain]
              for shape, chain in list(EAGLE.items()) if "int8" not in shape})


@pytest.mark.parametrize("shape", EAGLE)
def test_eagle_chains_greedy_equal_target_greedy(models, shape):
    """An untrained head proposes poorly, but whatever it proposes must not change the output."""
    target = models[0]
    chain = build_chain(EAGLE[shape], target, tokenizer=None)
    assert isinstance(chain.levels[-1], EagleLevel)
    assert chain.levels[-1].head.method == ("eagle3" if shape.endswith("eagle3") else "eagle")
    if "int8" in shape and runs_natively(as_prepared(target)):  # elsewhere the head keeps its own weights
        from decode.backends.cpu.llama import NativeInt8Linear

        assert isinstance(chain.levels[-1].runner.fc, NativeInt8Linear)
    for prompt in prompts(VOCAB, n=2):
        generation = chain.generate(prompt, 30)
        ok, _ = greedy_equal(target, prompt, generation.tokens)
        assert ok, f"{shape}: output differs from the target's greedy decoding at a clear margin"
        assert chain.levels[-1].stats.forward_calls > 0


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("mode", [{"length": 4}, TREE])
def test_eagle_with_draft_vocabulary_greedy_equals_target_greedy(models, mode, method):
    """A head that can only propose 40 of the 300 tokens: the rest must still come out, from the target."""
    from heads.eagle import EagleHead
    from heads.eagle3 import Eagle3Head

    target = models[0]
    levels = [{"kind": "model"}, {"kind": "eagle", "path": "untrained", "method": method, "draft": mode}]
    head_cls = Eagle3Head if method == "eagle3" else EagleHead
    head = head_cls.for_target(as_prepared(target).model, draft_vocab=torch.arange(0, VOCAB, 7)).eval()
    chain = build_chain(levels, target, tokenizer=None, head=head)
    assert tokens_outside(chain, target, every=7) > 0, ("every token was inside the draft vocabulary; "
                                                        "the test exercises nothing")


def tokens_outside(chain: Chain, target, every: int) -> int:
    """Decode 2 prompts, assert each equals the target's greedy output; count tokens not divisible by `every`
    (outside a vocabulary of every `every`-th token)."""
    outside = 0
    for prompt in prompts(VOCAB, n=2):
        generation = chain.generate(prompt, 30)
        ok, _ = greedy_equal(target, prompt, generation.tokens)
        assert ok, "a restricted vocabulary changed the target's greedy output at a clear margin"
        outside += sum(t % every != 0 for t in generation.tokens)
    return outside


@pytest.mark.parametrize("mode", [{"length": 3}, TREE])
def test_middle_level_with_restricted_vocabulary_greedy_equals_target_greedy(models, mode):
    """A W4-like middle level whose LM head covers 1 token in 3 (vocab: head): tokens outside its vocabulary
    can only come from the target, and the output must still be the target's."""
    target, middle, drafter = models
    chain = Chain([ModelLevel("t", target), ModelLevel("m", middle, mu=3, vocab=torch.arange(0, VOCAB, 3)),
                   ModelLevel("d", drafter, draft=mode)])
    assert (tokens_outside(chain, target, every=3) > 0
            and chain.levels[1].stats.accepted > 0), "the test exercises nothing"


def test_middle_level_with_int8_lm_head_greedy_equals_target_greedy(models):
    """`lm_head: int8` on the middle level (decode.backends.cpu.quantize_lm_head): its proposals change a little, the
    output must not; the config refuses it on the target itself."""
    from decode.engine.errors import DecodeError
    from decode.backends.cpu.int8 import Int8RowLinear

    target = models[0]
    config = [{"kind": "model"}, {"kind": "model", "model": "target", "layers": 3, "mu": 2, "lm_head": "int8"},
              {"kind": "model", "model": "target", "layers": 1, "draft": {"length": 3}}]
    chain = build_chain(config, target, tokenizer=None)
    middle = chain.levels[1].model
    head = middle.get_output_embeddings()
    assert isinstance(head, Int8RowLinear) and not isinstance(chain.levels[0].lm_head, Int8RowLinear)
    saved = middle.state_dict()  # the fp32 weight stays attached; the int8 copy is not saved
    assert "lm_head.weight" in saved and not any(k.endswith(("qweight", "scales")) for k in saved)
    h = torch.randn(5, middle.config.hidden_size)
    with torch.inference_mode():
        exact = h @ head.weight.T
        assert (head(h) - exact).abs().max() < 0.02 * exact.abs().max()  # int8 rows, bf16 activations
    for prompt in prompts(VOCAB, 4, seed=11):
        ok, _ = greedy_equal(target, prompt, chain.generate(prompt, 30).tokens)
        assert ok, "an int8 middle-level LM head changed the target's greedy output at a clear margin"
    assert chain.levels[1].stats.accepted > 0
    with pytest.raises(DecodeError, match="would change the target's own logits"):
        build_chain([{"kind": "model"}, {"kind": "model", "model": "target", "lm_head": "int8"}, config[2]], target,
                    tokenizer=None)
    with pytest.raises(DecodeError, match="lm_head must be one of int8, got .int4."):
        build_chain([config[0], {**config[1], "lm_head": "int4"}, config[2]], target, tokenizer=None)


def test_bf16_middle_level_in_a_packed_chain_greedy_equals_target_greedy(models):
    """A level in bf16 (`dtype: bfloat16`) with decode.fast on: oneDNN packs bf16 weights only on CPUs with
    bf16 support (an AVX2-only EPYC refuses at packing time); elsewhere the linears keep their plain forward."""
    import copy

    from decode.backends.cpu.dense import PackedLinear, packable_dtypes

    from decode.backends.cpu import pack, unpack

    target = models[0]
    middle = copy.deepcopy(as_prepared(target).model)
    unpack(middle)
    middle.to(torch.bfloat16)
    dense = sum(type(m) is torch.nn.Linear for m in middle.modules())
    bf16_packs = torch.bfloat16 in packable_dtypes()
    assert pack(middle) == (dense if bf16_packs else 0)
    linears = [m for m in middle.modules() if isinstance(m, (torch.nn.Linear, PackedLinear))]
    assert len(linears) == dense and all(isinstance(m, PackedLinear) == bf16_packs for m in linears)
    chain = Chain([ModelLevel("target", target), ModelLevel("bf16", middle, mu=2),
                   NgramLevel("lookup", draft={"mode": "chain", "length": 3})])
    for prompt in prompts(VOCAB, 3, seed=12):
        ok, _ = greedy_equal(target, prompt, chain.generate(prompt, 24).tokens)
        assert ok, "a bf16 middle level changed the target's greedy output at a clear margin"


def test_sibling_linears_run_fused_with_the_unfused_packed_logits():
    """decode.backends.cpu.pack runs q/k/v and gate/up (found by tracing, not by name) as one product each: a cached
    decode gives bit-identical logits to the unfused packed model; a sibling handed another input computes
    alone; a deep copy runs unfused on its own copy of the weights. Where the fused forward is not bit-identical
    on this machine the fusion is undone as a whole: the logits are asserted either way."""
    import copy

    from transformers import DynamicCache

    from decode.backends.cpu.dense import PackedLinear, pack_weight

    from decode.backends.siblings import SiblingGroup

    fused, alone = packed(tiny_model(seed=4, vocab=VOCAB)), packed(tiny_model(seed=4, vocab=VOCAB))
    for m in alone.modules():
        if isinstance(m, PackedLinear) and m.sibling is not None:
            m.sibling, m.packed = None, pack_weight(m.weight.detach(), m.gemm)
    groups = {id(m.sibling[0]): m.sibling[0] for m in fused.modules() if getattr(m, "sibling", None)}
    assert len(groups) in (0, 2 * fused.config.num_hidden_layers) and all(isinstance(g, SiblingGroup)
                                                                          for g in groups.values())
    attention = fused.model.layers[0].self_attn
    ids = torch.tensor([prompts(VOCAB, 1, seed=5)[0]])
    with torch.inference_mode():
        for model in (fused, alone):
            cache = DynamicCache(config=model.config)
            model.steps = [model(ids[:, :9], past_key_values=cache).logits] + [
                model(ids[:, i:i + k], past_key_values=cache).logits for i, k in ((9, 1), (10, 4), (14, 1))]
        assert all(torch.equal(a, b) for a, b in zip(fused.steps, alone.steps))
        if not groups:
            return  # the fusion did not hold here bit for bit and was undone: nothing fused left to check
        assert attention.q_proj.sibling[0] is attention.k_proj.sibling[0] is attention.v_proj.sibling[0]
        x, other = torch.randn(1, 3, 64), torch.randn(1, 3, 64)
        attention.q_proj(x)
        assert torch.equal(attention.k_proj(other), torch.nn.functional.linear(other, attention.k_proj.weight))
        clone = copy.deepcopy(fused).model.layers[0].self_attn
        assert clone.k_proj.sibling is None and clone.k_proj.weight is not attention.k_proj.weight
        assert torch.allclose(clone.k_proj(x), torch.nn.functional.linear(x, attention.k_proj.weight), atol=1e-5)


def test_packed_grouped_query_attention_skips_repeat_kv_with_the_same_logits(monkeypatch):
    """decode.backends.cpu.pack swaps HF's sdpa attention for one that hands grouped K/V heads to SDPA with a mask
    (no repeat_kv copy): a cached verification with a tree mask gives bit-identical logits; unpack restores sdpa."""
    from transformers import DynamicCache
    from transformers.integrations import sdpa_attention

    from decode.backends.cpu.attention import GROUPED_SDPA

    from decode.backends.cpu import unpack
    from decode.engine.tree import Tree

    # the AVX2 product brings its own attention (test_cpu_kernels)
    model = packed(tiny_model(seed=6, vocab=VOCAB), "onednn")
    assert (model.config._attn_implementation == GROUPED_SDPA
            and model.config.num_key_value_heads < model.config.num_attention_heads)
    ids = torch.tensor([prompts(VOCAB, 1, seed=7)[0]])
    tree = Tree()
    for token, parent in ((5, -1), (9, 0), (7, 0), (11, 1)):
        tree.add(token, parent)
    mask, positions = tree.attention_mask(12, 12, torch.float32), tree.position_ids(12, 12)
    runs, copies = [], []
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda x, n: copies.append(n) or torch.repeat_interleave(x, n, 1))
    for implementation in (GROUPED_SDPA, "sdpa"):
        model.set_attn_implementation(implementation)
        copies.clear()
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            first = model(ids[:, :12], past_key_values=cache).logits
            verify = model(ids[:, 12:16], past_key_values=cache, attention_mask=mask, position_ids=positions).logits
        runs.append((first, verify))
        assert bool(copies) == (implementation == "sdpa")
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    model.set_attn_implementation(GROUPED_SDPA)
    unpack(model)
    assert model.config._attn_implementation == "sdpa"


def test_restricted_vocabulary_comes_from_the_chains_head_and_never_on_the_target(models, monkeypatch):
    from decode.chains import build
    from decode.engine.errors import DecodeError
    from heads.eagle import EagleHead

    target = models[0]
    config = [{"kind": "model"}, {"kind": "model", "model": "target", "layers": 3, "mu": 2, "vocab": "head"},
              {"kind": "eagle", "path": "untrained", "draft": {"length": 3}}]
    with pytest.raises(DecodeError, match="needs an EAGLE level whose head has a draft vocabulary"):
        build_chain(config, target, tokenizer=None)
    with pytest.raises(DecodeError, match="the target cannot have a restricted vocabulary"):
        build_chain([{"kind": "model", "vocab": "head"}, *config[1:]], target, tokenizer=None)
    head = EagleHead.for_target(as_prepared(target).model, draft_vocab=torch.arange(0, VOCAB, 5)).eval()
    monkeypatch.setattr(build, "_eagle_head", lambda *args: head)  # the head is loaded after the level it restricts
    chain = build_chain(config, target, tokenizer=None)
    assert chain.levels[-1].head is head and torch.equal(chain.levels[1].vocab, head.draft_vocab)


def test_eos_stops_generation(models):
    target, middle, _ = models
    prompt = prompts(VOCAB, n=1)[0]
    reference = Chain([ModelLevel("t", target),
                       ModelLevel("d", middle, draft={"length": 4})]).generate(prompt, 30).tokens
    eos = reference[10]
    chain = Chain([ModelLevel("t", target), ModelLevel("m", middle, mu=3), NgramLevel("n", draft={"length": 4})])
    tokens = chain.generate(prompt, 30, eos_token_id=eos).tokens
    assert tokens == reference[: reference.index(eos) + 1]


@pytest.mark.slow
def test_real_model_three_level_chain_is_lossless(bundled_target):
    """SmolLM2-135M target <- 12-layer early-exit copy (mu 3) <- prompt lookup, on a real chat prompt.

    About 15 s on this 2-core machine."""
    from data.sharegpt import chat_prompt_ids

    model, tokenizer = bundled_target
    prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": "List three uses of a hash table, briefly."}])
    chain = build_chain([{"kind": "model"}, {"kind": "model", "model": "target", "layers": 12, "mu": 3},
                         {"kind": "ngram", "draft": {"length": 4}}], model, tokenizer)
    generation = chain.generate(prompt, 48, eos_token_id=tokenizer.eos_token_id)
    ok, ties = greedy_equal(model, prompt, generation.tokens)
    assert ok, "the chain changed the target's greedy output at a clear margin"


@pytest.mark.slow
def test_real_model_tree_drafting_is_lossless(bundled_target):
    """SmolLM2-135M target <- 10-layer early-exit copy drafting an EAGLE-2 tree. About 10 s here."""
    from data.sharegpt import chat_prompt_ids

    model, tokenizer = bundled_target
    prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": "Write one sentence about the sea."}])
    chain = build_chain([{"kind": "model"}, {"kind": "model", "model": "target", "layers": 10,
                          "draft": {"mode": "tree", "depth": 4, "top_k": 4, "total_tokens": 12}}], model, tokenizer)
    generation = chain.generate(prompt, 32, eos_token_id=tokenizer.eos_token_id)
    ok, _ = greedy_equal(model, prompt, generation.tokens)
    assert ok, "tree drafting changed the target's greedy output at a clear margin"


@pytest.mark.slow
def test_real_packed_target_decodes_like_the_eager_target(bundled_target):
    """decode.fast changes only the summation order of the target's matrix products: its greedy output
    equals the plain eager target's, except at a numerical near-tie of the eager target's top-2 logits."""
    from data.sharegpt import chat_prompt_ids
    from decode.chains.baselines import autoregressive
    from decode_fixtures import packed as packed_copy

    model, tokenizer = bundled_target
    fast = packed_copy(model)
    for question in ("Explain what a compiler does in two sentences.",
                     "Translate 'good morning' into French and Spanish."):
        prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": question}])
        tokens = autoregressive(fast, prompt, 48, eos_token_id=tokenizer.eos_token_id).tokens
        ok, _ = greedy_equal(model, prompt, tokens)
        assert ok, f"the packed target's greedy output differs from the eager target's at a clear margin: {question!r}"


@pytest.mark.slow
def test_real_packed_dualistic_chain_with_draft_vocabulary_is_lossless(bundled_target):
    """The default fast path on the real model: packed target <- head with an 8k draft vocabulary (tree)."""
    from data.sharegpt import chat_prompt_ids
    from heads.eagle import EagleHead
    from decode_fixtures import packed as packed_copy

    model, tokenizer = bundled_target
    fast = packed_copy(model)
    prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": "Give two tips for writing clear emails."}])
    head = EagleHead.for_target(fast, draft_vocab=torch.arange(8192)).eval()
    chain = build_chain([{"kind": "model"}, {"kind": "eagle", "path": "untrained", "draft": TREE}], fast, tokenizer,
                        head=head)
    generation = chain.generate(prompt, 32, eos_token_id=tokenizer.eos_token_id)
    ok, _ = greedy_equal(fast, prompt, generation.tokens)
    assert ok, "the packed chain changed the packed target's greedy output at a clear margin"
