"""The native W4 Llama runner (decode/backends/cpu/llama.py): the same W4 model as GPTQModel's forward, the
HF cache semantics a ModelLevel relies on (crop, keep a tree path, tree masks), row exactness, refusals.

Fast tests quantize a tiny random Llama (hidden 192, head dim 48, grouped K/V heads) once per act order and
compare the fp32-activation runner with an fp32 Llama holding the dequantized W4 weights (the same model computed
by HF, so only summation order differs) and the int8-activation runner with the fp32 one; the slow test quantizes
the real bundled model with reduced settings."""
from __future__ import annotations

import copy

import pytest
import torch
from w4_fixtures import held_out_text, stage_config
from omegaconf import OmegaConf
from transformers import LlamaForCausalLM

from decode.backends.cpu.llama import (NativeInt8Linear, NativeLlamaRunner, int4_parts, int4_weight, int8_weight,
                                       native_kernels, unsupported)
from decode.engine.runner import HFRunner
from decode.engine.tree import Tree

pytestmark = [pytest.mark.cpu_kernels,
              pytest.mark.skipif(native_kernels()[0] is None, reason="the native kernels do not build here")]


@pytest.fixture(scope="module", params=[True, False], ids=["act_order", "static"])
def w4_folder(request, tiny_source, chat_file, tmp_path_factory):  # noqa: F811
    from quantize.settings import w4_of
    from quantize.w4 import run

    return run(w4_of(stage_config(tiny_source, chat_file, tmp_path_factory.mktemp("run"), desc_act=request.param)))


@pytest.fixture
def w4(w4_folder):
    from data.models import load_model

    return load_model(str(w4_folder))[0]


def dequantized(model: torch.nn.Module) -> LlamaForCausalLM:
    """An fp32 Llama with the weights GPTQModel's CPU kernel computes with: (code - 8) * bf16 scale."""
    config = copy.deepcopy(model.config)
    del config.quantization_config
    plain = LlamaForCausalLM(config).eval()
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if k in plain.state_dict()}, strict=False)
    for name, module in model.named_modules():
        if type(module).__name__ == "TorchFusedLinear":
            codes, scales, perm = int4_parts(module)
            groups = torch.arange(codes.shape[1]) // module.group_size
            weight = torch.empty(codes.shape)
            weight[:, perm] = (codes.float() - 8) * scales[:, groups]
            plain.get_submodule(name).weight.data.copy_(weight)
    return plain


def text(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 300, (1, n), generator=torch.Generator().manual_seed(seed))


def fake_quantized(x: torch.Tensor) -> torch.Tensor:
    """Rows of x as the int8-activation kernels see them: per 16 inputs, codes x * (127 / absmax) rounded to nearest
    even, each step computed in float32 as the kernels do (a code computed in float64 differs from theirs wherever
    x lands near a rounding tie), the dequantized rows in float64."""
    blocks = x.float().reshape(x.shape[0], -1, 16)
    most = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(most > 0, torch.full_like(most, 127) / most, torch.zeros_like(most))  # not 127 / most:
    # torch computes a scalar over a tensor as 127 * (1 / most), rounded twice
    return (torch.round(blocks * inverse).double() * (most / 127).double()).reshape(x.shape)


def test_the_forward_is_the_dequantized_w4_model(w4, one_thread):
    reference, runner, ids = HFRunner(dequantized(w4)), NativeLlamaRunner(w4, 128, "fp32"), text(40)
    for lo, hi in ((0, 30), (30, 31), (31, 40)):  # a prefill, one token, a verification
        with torch.no_grad():
            ours, theirs = runner.forward(ids[:, lo:hi], None, None), reference.forward(ids[:, lo:hi], None, None)
        assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4), (lo, (ours - theirs).abs().max())
    assert runner.cached() == 40


def test_captured_states_are_the_states_entering_the_layers(w4, one_thread):
    """EAGLE-3's aux states (runner.capture): the hidden states entering the asked layers, as HF's
    output_hidden_states[i] of the dequantized model gives them, through a prefill, one token and a verification."""
    layers = (0, 1, 1)
    reference, runner, ids = HFRunner(dequantized(w4)), NativeLlamaRunner(w4, 128, "fp32"), text(20)
    reference.capture(layers)
    runner.capture(layers)
    for lo, hi in ((0, 12), (12, 13), (13, 20)):
        with torch.no_grad():
            runner.forward(ids[:, lo:hi], None, None), reference.forward(ids[:, lo:hi], None, None)
        ours, theirs = runner.captured, reference.captured
        assert ours.shape == theirs.shape == (1, hi - lo, 3 * w4.config.hidden_size)
        assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4), (lo, (ours - theirs).abs().max())


@pytest.mark.parametrize("activations, tolerance", [("fp32", 0.1), ("int8", 0.25)])
def test_logits_agree_with_gptqmodels_forward(w4, activations, tolerance, one_thread):
    """GPTQModel's CPU kernel rounds activations to bf16, the int8 runner to 8 bits per group: logits (about +-2)
    within the tolerance, argmax almost everywhere (a random tiny model has near ties)."""
    ids = text(60, seed=1)
    with torch.no_grad():
        theirs = w4(ids).logits
    ours = w4.lm_head(NativeLlamaRunner(w4, 128, activations).forward(ids, None, None))
    assert (ours - theirs).abs().max() < tolerance
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("activations", ["fp32", "int8"])
def test_a_forward_of_k_tokens_gives_the_bits_of_k_one_token_forwards(w4, activations):
    ids, runner = text(12, seed=2), NativeLlamaRunner(w4, 64, activations)
    runner.forward(ids[:, :4], None, None)
    together = runner.forward(ids[:, 4:], None, None)
    runner.crop(4)
    alone = torch.cat([runner.forward(ids[:, i:i + 1], None, None) for i in range(4, 12)], dim=1)
    assert torch.equal(together, alone)
    torch.set_num_threads(1)  # and whatever the thread count
    runner.crop(4)
    assert torch.equal(runner.forward(ids[:, 4:], None, None), together)


def test_a_tree_then_its_accepted_path_like_an_hf_cache(w4, one_thread):
    """What a ModelLevel does with its runner: a tree forward under a mask with tree positions, keeping the
    accepted path, cropping, going on; the same as the engine's HFRunner on the dequantized model."""
    reference, runner, ids = HFRunner(dequantized(w4)), NativeLlamaRunner(w4, 64, "fp32"), text(16, seed=3)
    tree = Tree()
    a = tree.add(7, -1)
    b = tree.add(8, a)
    tree.add(9, a)
    tree.add(10, b)
    mask, positions = tree.attention_mask(16, 16, torch.float32), tree.position_ids(16, 16)
    nodes, more = torch.tensor([tree.tokens]), text(3, seed=4)
    results = []
    for r in (runner, reference):
        with torch.no_grad():
            r.forward(ids, None, None)
            on_tree = r.forward(nodes, mask, positions)
            r.keep(torch.tensor([*range(16), 16, 17, 19]))  # context, then the path a -> b -> its child
            r.crop(18)
            results.append((on_tree, r.forward(more, None, None), r.cached()))
    (tree_ours, after_ours, cached), (tree_theirs, after_theirs, cached_hf) = results
    assert torch.allclose(tree_ours, tree_theirs, atol=1e-4, rtol=1e-4)
    assert torch.allclose(after_ours, after_theirs, atol=1e-4, rtol=1e-4) and cached == cached_hf == 21


def test_the_int4_product_is_the_fp32_product_of_the_dequantized_weight_bit_for_bit(w4):
    """One FMA chain per output over the act-ordered inputs, dequantization exact: the fp32 kernel's bits."""
    from decode.backends.cpu.kernels import kernel_ops

    module = w4.model.layers[0].mlp.down_proj
    codes, scales, perm = int4_parts(module)
    kernels = native_kernels()[0]
    words, panel_scales = kernels.pack_int4(codes, scales)
    k = codes.shape[1]
    bounds = torch.tensor([*range(0, k, module.group_size), k])
    x = torch.randn(5, k)
    packed = kernels.PackedWeight(words=words, scales=panel_scales, bounds=bounds, n=codes.shape[0], perm=perm)
    ours = kernels.packed_mm(x, packed)
    weight = (codes.float() - 8) * scales[:, torch.arange(k) // module.group_size]
    fp32 = kernel_ops()[0]
    assert torch.equal(ours, fp32.linear(x[:, perm].contiguous(), fp32.pack(weight), weight.shape[0], None))


def test_the_int8_activation_product_is_the_exact_product_of_the_quantized_rows(w4):
    """Each row quantized per 16 inputs (absmax / 127, nearest even), integer dot products, then the scales:
    the float64 product of the fake-quantized rows and the dequantized weight, up to fp32 rounding."""
    module = w4.model.layers[0].mlp.down_proj
    codes, scales, perm = int4_parts(module)
    kernels, k, size = native_kernels()[0], codes.shape[1], module.group_size
    words, panel_scales = kernels.pack_int4_a8(codes, scales)
    bounds = torch.tensor([*range(0, k, size), k])
    x = torch.randn(5, k) * 3
    weight = kernels.PackedWeight(words=words, scales=panel_scales, bounds=bounds, n=codes.shape[0], perm=perm)
    ours = kernels.packed_mm(x, weight)
    quantized = fake_quantized(x[:, perm])
    weight = (codes.double() - 8) * scales.double()[:, torch.arange(k) // size]
    exact = quantized @ weight.T
    assert ((ours - exact).abs().max() / exact.abs().max()) < 1e-5


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_int8_activation_products_hold_their_largest_integer_sums(kind, sign):
    """Every weight at its largest code (int4 15, int8 127) against inputs all at +-127 (constant rows): the
    integer sums are the largest the kernels accumulate (on AVX2, int4 blocks in int16 until the block ends), and
    the products stay within fp32 rounding of the exact value. An accumulator widened too late saturates here."""
    kernels, k, n = native_kernels()[0], 128, 24
    x = torch.full((3, k), sign * 0.5)
    if kind == "int4":
        words, scales = kernels.pack_int4_a8(torch.full((n, k), 15, dtype=torch.int32), torch.full((n, 2), 0.25))
        weight = kernels.PackedWeight(words=words, scales=scales, bounds=torch.tensor([0, 64, k]), n=n)
        exact = sign * 0.5 * (15 - 8) * 0.25 * k
    else:
        words, scales = kernels.pack_int8(torch.full((n, k), 127, dtype=torch.int8), torch.full((n,), 0.25))
        weight = kernels.PackedWeight(words=words, scales=scales, bounds=torch.tensor([0, k]), n=n)
        exact = sign * 0.5 * 127 * 0.25 * k
    assert torch.allclose(kernels.packed_mm(x, weight), torch.full((3, n), exact), rtol=1e-6, atol=0)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_int8_activation_rows_do_not_depend_on_the_batch_the_tiles_or_the_threads(kind):
    """Rows 1 to 13 (every tail of the 4-row tile) against 5 panels and part of a sixth (the two-panel tasks, the
    narrower tiles a task splits into where rows leave too few registers, the odd panel done alone): each row has
    the bits of that row computed alone, on 1 to 3 threads."""
    kernels, k = native_kernels()[0], 256
    n = 5 * kernels.lanes() + 3
    gen = torch.Generator().manual_seed(7)
    if kind == "int4":
        codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
        weight = int4_weight(kernels, (codes, torch.rand(n, k // 128, generator=gen) + 0.1, None), 128, "int8")
    else:
        weight = int8_weight(kernels, [torch.nn.Linear(k, n, bias=False)])
    x = torch.randn(13, k, generator=gen)
    alone = torch.cat([kernels.packed_mm(x[m:m + 1], weight) for m in range(13)])
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            for m in range(1, 14):
                assert torch.equal(kernels.packed_mm(x[:m], weight), alone[:m]), (count, m)
    finally:
        torch.set_num_threads(threads)


def test_int8_activations_stay_close_to_fp32_ones(w4, one_thread):
    """The same W4 model on int8 activations: hidden states near the exact ones, the same greedy tokens nearly
    everywhere (the real model's agreement with GPTQModel: the slow test)."""
    ids = text(50, seed=5)
    exact = NativeLlamaRunner(w4, 64, "fp32").forward(ids, None, None)
    fast = NativeLlamaRunner(w4, 64, "int8").forward(ids, None, None)
    assert ((fast - exact).norm(dim=-1) / exact.norm(dim=-1)).max() < 0.05
    assert (w4.lm_head(fast).argmax(-1) == w4.lm_head(exact).argmax(-1)).float().mean() >= 0.9


def test_the_cache_capacity_is_checked(w4):
    runner = NativeLlamaRunner(w4, capacity=8)
    runner.forward(text(6), None, None)
    with pytest.raises(ValueError, match="holds 8 positions"):
        runner.forward(text(3), None, None)
    with pytest.raises(IndexError):
        runner.keep(torch.tensor([0, 6]))


@pytest.mark.parametrize("activations", ["int8", "fp32"])
def test_the_runner_counts_the_bytes_a_forward_streams_from_the_checkpoint(w4, activations):
    """The runner's count (the C++ decoder's buffers) against the checkpoint's: 4-bit codes as stored (qweight), a
    float32 scale per output and group (the stored 16-bit scales, widened), each product's group bounds (int64) and,
    in act order, its input order (int64), the norms, and the keys and values of the cached positions."""
    runner = NativeLlamaRunner(w4, 64, activations)
    runner.forward(text(10), None, None)
    config, count = w4.config, 0
    for layer in w4.model.layers:
        count += layer.input_layernorm.weight.nbytes + layer.post_attention_layernorm.weight.nbytes
        a, m = layer.self_attn, layer.mlp
        for product in ([a.q_proj, a.k_proj, a.v_proj], [a.o_proj], [m.gate_proj, m.up_proj], [m.down_proj]):
            first = product[0]
            count += sum(p.qweight.nbytes + 2 * p.scales.nbytes for p in product)
            count += 8 * (len(range(0, first.in_features, first.group_size)) + 1)
            if not torch.equal(first.ret_idx.long(), torch.arange(first.in_features)):
                count += 8 * first.in_features
    count += w4.model.norm.weight.nbytes
    head_dim = config.hidden_size // config.num_attention_heads
    count += 2 * config.num_hidden_layers * config.num_key_value_heads * 10 * head_dim * 4
    assert runner.streamed_bytes() == count


def test_unsupported_models_are_refused_with_a_reason(w4, tiny_llama):
    assert unsupported(w4) is None and unsupported(tiny_llama) is None  # W4, and fp32 (test_native_target.py)
    tiny_llama.to(torch.bfloat16)
    for key, value, says in (("hidden_act", "gelu", "activation"), ("model_type", "gpt2", "architecture"),
                             ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}, "rope type"),
                             ("quantization_config", {"quant_method": "gptq", "bits": 8, "sym": True},
                              "not symmetric")):
        config = copy.deepcopy(w4.config)
        setattr(config, key, value)
        w4.config, original = config, w4.config
        assert says in unsupported(w4)
        w4.config = original
    with pytest.raises(ValueError, match="cannot run this model"):
        NativeLlamaRunner(tiny_llama)


def test_the_native_int8_head_is_the_product_of_its_int8_rows_and_quantized_inputs(w4):
    from decode.backends.cpu.int8 import Int8RowLinear

    int8 = Int8RowLinear(w4.get_output_embeddings())
    head, x = NativeInt8Linear(int8), torch.randn(3, int8.in_features)
    exact = fake_quantized(x) @ (int8.qweight.double() * int8.scales.double()[:, None]).T
    assert ((head(x) - exact).abs().max() / exact.abs().max()) < 1e-5
    assert torch.allclose(head(x), int8(x), atol=0.05, rtol=0.02)  # aten's kernel rounds activations to bf16


def real_text_agreement(model, tokenizer, activations: str) -> tuple[float, float]:
    """(share of positions where the native forward's argmax equals GPTQModel's, max |logit difference|) over
    held-out ShareGPT text, one forward per conversation."""
    agree, gap, positions = 0.0, 0.0, 0
    with torch.no_grad():
        for ids in held_out_text(tokenizer):
            theirs = model(ids).logits
            ours = model.lm_head(NativeLlamaRunner(model, 512, activations).forward(ids, None, None))
            agree += (ours.argmax(-1) == theirs.argmax(-1)).sum().item()
            gap, positions = max(gap, (ours - theirs).abs().max().item()), positions + ids.shape[1]
    return agree / positions, gap


# Bounds from both CPU kinds' code paths on the real model quantized with the reduced settings below (BENCHMARKS.md,
# "Tolerances"): GPTQ's own float arithmetic differs between AVX2 and AVX-512 hosts, so the W4 weights do too, and
# near-tied logits flip; the worst logit gap grows on int8 activations (per-16 rounding of every layer's input).
AGREEMENT = {"fp32": (0.97, 1.5), "int8": (0.95, 3.0)}


@pytest.mark.slow
def test_the_bundled_w4_model_agrees_with_gptqmodel_on_real_text(bundled_w4):
    """The real SmolLM2 quantized with reduced settings (tests/conftest.py)."""
    from data.models import load_model

    model, tokenizer = load_model(str(bundled_w4))
    assert unsupported(model) is None
    for activations, (least, most) in AGREEMENT.items():
        agreement, gap = real_text_agreement(model, tokenizer, activations)
        print(f"{torch.backends.cpu.get_cpu_capability()} {activations}: agreement {agreement:.4f}, gap {gap:.3f}")
        assert agreement >= least and gap < most, (activations, agreement, gap)


@pytest.mark.parametrize("draft", [{"length": 4}, {"mode": "tree", "depth": 3, "top_k": 2, "total_tokens": 6}],
                         ids=["chain", "tree"])
def test_a_native_w4_drafter_keeps_decoding_lossless(w4, tiny_source, draft, one_thread):  # noqa: F811
    """target <- W4 (native runner): the greedy tokens are the target's own."""
    from lossless_fixtures import greedy_equal

    from decode.backends import Backend
    from decode.engine.chain import Chain
    from decode.engine.levels import ModelLevel

    target = LlamaForCausalLM.from_pretrained(tiny_source).eval()
    chain = Chain([ModelLevel("t", target), ModelLevel("w4", Backend(native_w4="on").prepare(w4), draft=draft)])
    assert isinstance(chain.levels[1].runner, NativeLlamaRunner)
    for seed in range(2):
        prompt = text(12, seed=10 + seed)[0].tolist()
        ok, _ = greedy_equal(target, prompt, chain.generate(prompt, 30).tokens)
        assert ok


def w4_invariants(w4, tiny_source, draft: dict) -> tuple[bool, bool, bool, int]:
    """target <- W4 (native runner, mu 2) <- a noisy copy of the target, and W4 <- that drafter, on 2 prompts: (the
    output is the target's, every block the W4 level hands up is W4's own greedy continuation, W4 <- drafter decodes
    exactly as W4 alone, how many drafted tokens W4 accepted in the three-level chain). A middle level's error does
    not reach the output (the target corrects it): only the second and third see it."""
    from decode_fixtures import noisy_copy
    from lossless_fixtures import greedy_equal, handed_up, self_consistent

    from decode.backends import Backend
    from decode.engine.chain import Chain
    from decode.engine.levels import ModelLevel

    target = LlamaForCausalLM.from_pretrained(tiny_source).eval()
    middle, drafter = Backend(native_w4="on").prepare(w4), noisy_copy(target, 0.1, seed=3)
    three = Chain([ModelLevel("t", target), ModelLevel("w4", middle, mu=2), ModelLevel("d", drafter, draft=draft)])
    two = Chain([ModelLevel("w4", middle), ModelLevel("d", drafter, draft=draft)])
    assert isinstance(three.levels[1].runner, NativeLlamaRunner) and isinstance(two.levels[0].runner, NativeLlamaRunner)
    blocks, lossless, w4_alone = handed_up(three), True, True
    for seed in range(2):
        prompt = text(12, seed=30 + seed)[0].tolist()
        lossless &= greedy_equal(target, prompt, three.generate(prompt, 30).tokens)[0]
        w4_alone &= greedy_equal(middle, prompt, two.generate(prompt, 30).tokens)[0]
    assert blocks and three.levels[1].stats.proposed > 0, "the W4 level verified nothing: the test exercises nothing"
    return lossless, self_consistent(blocks, {1: middle}), w4_alone, three.levels[1].stats.accepted


W4_DRAFTS = {"chain": {"length": 4}, "tree": {"mode": "tree", "depth": 3, "top_k": 2, "total_tokens": 6}}


@pytest.mark.parametrize("draft", W4_DRAFTS)
def test_a_native_w4_level_is_lossless_with_respect_to_itself(w4, tiny_source, draft, one_thread):  # noqa: F811
    *invariants, accepted = w4_invariants(w4, tiny_source, W4_DRAFTS[draft])
    assert invariants == [True, True, True] and accepted > 0  # some drafts taken: W4's accept path ran too


@pytest.mark.parametrize("draft", W4_DRAFTS)
def test_a_wrong_row_in_the_native_w4_verify_is_caught(w4, tiny_source, draft, monkeypatch, one_thread):  # noqa: F811
    """Planted: the native runner's forward of several tokens on a W4 model returns its rows one position early (row
    t holds position t + 1's states, the last row twice): in a verification every row but the last checks its
    drafted token against the next position's logits, mostly a wrong argmax (on Zen 3 always: W4 accepts nothing). A
    prefill reads only its last row, so W4's own one-token AR reference is untouched. The target corrects the W4
    level, so the output stays the target's; both of W4's own checks in
    test_a_native_w4_level_is_lossless_with_respect_to_itself fail: a block it hands up is not its greedy
    continuation, and W4 <- drafter parts from W4 alone. (A single wrong row, the second-to-last, was caught on too few
    prompts under a tree draft: on an Intel AVX2 path W4 <- drafter matched W4 alone on both.)"""
    forward = NativeLlamaRunner.forward

    def planted(self, ids, mask=None, positions=None):
        hidden = forward(self, ids, mask, positions)
        if ids.shape[-1] > 1 and getattr(self.config, "quantization_config", None):
            hidden[:, :-1] = hidden[:, 1:].clone()
        return hidden

    monkeypatch.setattr(NativeLlamaRunner, "forward", planted)
    assert w4_invariants(w4, tiny_source, W4_DRAFTS[draft])[:3] == (True, False, False)  # it may accept nothing


def test_decode_native_is_checked_before_anything_loads():

    from decode.engine.errors import DecodeError
    from decode.settings import decoding_of

    def decoding(decode: dict):
        return decoding_of(OmegaConf.create({"run_dir": "runs/x", "model": {"name": "m", "dtype": "float32"},
                                             "decode": decode}))

    with pytest.raises(DecodeError, match="^decode.native must be one of auto, on, off"):
        decoding({"fast": True, "native": "yes"})
    with pytest.raises(DecodeError, match="^decode.w4_activations must be one of int8, fp32"):
        decoding({"fast": True, "w4_activations": "int4"})


def test_an_eagle3_head_below_a_native_w4_level_keeps_decoding_lossless(w4, tiny_source, one_thread):  # noqa: F811
    """target <- W4 (native runner, mu 2) <- EAGLE-3 head: the W4 level hands down the aux states its native forward
    captured, and the greedy tokens are the target's own."""
    from lossless_fixtures import greedy_equal

    from decode.backends import Backend
    from decode.engine.chain import Chain, read_features
    from heads.eagle3 import Eagle3Head
    from decode.engine.levels import EagleLevel, ModelLevel

    target = LlamaForCausalLM.from_pretrained(tiny_source).eval()
    head = Eagle3Head(target, init_std=0.2).eval()
    top = ModelLevel("t", target).keeping(head.aux_layers)
    middle = ModelLevel("w4", Backend(native_w4="on").prepare(w4), mu=2).keeping(head.aux_layers)
    drafter = EagleLevel("head", head, read_features([middle, top], head.feature_size, target.dtype), {"length": 3})
    chain = Chain([top, middle, drafter])
    assert isinstance(middle.runner, NativeLlamaRunner)
    for seed in range(2):
        prompt = text(12, seed=20 + seed)[0].tolist()
        ok, _ = greedy_equal(target, prompt, chain.generate(prompt, 24).tokens)
        assert ok and drafter.stats.forward_calls > 0
