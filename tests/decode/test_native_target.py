"""The fp32 target on the native runner (decode/backends/cpu/decoder.cpp through decode.backends.cpu.llama): the
same model as the packed HF forward up to summation order, row-exact (k tokens, or a tree, in one call give the bits
of the path fed one token at a time), the packed panels shared rather than copied, and the configuration every
runner of the model follows (the chain's levels and the AR reference alike), with refusals said once."""
from __future__ import annotations

import copy

import pytest
import torch
from decode_fixtures import packed, tiny_model

from decode.backends import Backend
from decode.backends.cpu.llama import NativeLlamaRunner, native_kernels, unsupported
from decode.engine.runner import HFRunner
from decode.engine.tree import Tree

pytestmark = [pytest.mark.skipif(native_kernels()[0] is None, reason="the native kernels do not build here"),
              pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def model():
    return packed(tiny_model(seed=8), "avx2")


def text(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 300, (1, n), generator=torch.Generator().manual_seed(seed))


def test_the_forward_is_the_packed_hf_forward_up_to_rounding(model):
    reference, runner, ids = HFRunner(model), NativeLlamaRunner(model, 64), text(40)
    for lo, hi in ((0, 30), (30, 31), (31, 40)):  # a prefill, one token, a verification
        with torch.no_grad():
            ours, theirs = runner.forward(ids[:, lo:hi], None, None), reference.forward(ids[:, lo:hi], None, None)
        assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5), (lo, (ours - theirs).abs().max())
    assert runner.cached() == 40


def test_a_plain_model_runs_on_panels_packed_for_it(model):
    plain, ids = tiny_model(seed=8), text(20, seed=1)
    with torch.no_grad():
        assert torch.equal(NativeLlamaRunner(plain, 32).forward(ids, None, None),
                           NativeLlamaRunner(model, 32).forward(ids, None, None))


def test_a_forward_of_k_tokens_gives_the_bits_of_k_one_token_forwards(model):
    ids, runner = text(20, seed=2), NativeLlamaRunner(model, 64)
    runner.forward(ids[:, :12], None, None)
    together = runner.forward(ids[:, 12:], None, None)
    runner.crop(12)
    alone = torch.cat([runner.forward(ids[:, i:i + 1], None, None) for i in range(12, 20)], dim=1)
    assert torch.equal(together, alone)
    torch.set_num_threads(2)  # and whatever the thread count
    runner.crop(12)
    assert torch.equal(runner.forward(ids[:, 12:], None, None), together)


def test_a_tree_verification_gives_the_bits_of_its_path_one_token_at_a_time(model):
    """A tree 5 -> {9, 7}, 7 -> 11 under its mask and tree positions: the rows of the path 5, 7, 11 are the bits of
    feeding the path alone; keeping the path and going on matches HF's cache on the same model."""
    context, runner, reference = text(12, seed=3), NativeLlamaRunner(model, 64), HFRunner(model)
    tree = Tree()
    for token, parent in ((5, -1), (9, 0), (7, 0), (11, 2)):
        tree.add(token, parent)
    mask, positions = tree.attention_mask(12, 12, torch.float32), tree.position_ids(12, 12)
    results = []
    for r in (runner, reference):
        with torch.no_grad():
            r.forward(context, None, None)
            verified = r.forward(torch.tensor([tree.tokens]), mask, positions)
            r.keep(torch.tensor([*range(12), 12, 14, 15]))  # the context, then the path 5 -> 7 -> 11
            results.append((verified, r.forward(text(3, seed=4), None, None), r.cached()))
    runner.crop(12)
    path = torch.cat([runner.forward(torch.tensor([[t]]), None, None) for t in (5, 7, 11)], dim=1)
    (verified, after, cached), (verified_hf, after_hf, cached_hf) = results
    assert torch.equal(verified[:, [0, 2, 3]], path)
    assert torch.allclose(verified, verified_hf, atol=1e-5) and torch.allclose(after, after_hf, atol=1e-5)
    assert cached == cached_hf == 18


def test_the_packed_panels_are_shared_not_copied(model):
    from decode.backends.cpu.llama import _dense_siblings, _shared_weight

    kernels, attention, mlp = native_kernels()[0], model.model.layers[0].self_attn, model.model.layers[0].mlp
    fused = _dense_siblings(kernels, [attention.q_proj, attention.k_proj, attention.v_proj])
    group = attention.q_proj.sibling[0]
    assert len(fused) == 1 and fused[0].words.data_ptr() == group.run.packed.data.data_ptr()
    assert fused[0].n == sum(p.out_features for p in (attention.q_proj, attention.k_proj, attention.v_proj))
    assert _shared_weight(kernels, mlp.down_proj).words.data_ptr() == mlp.down_proj.packed.data.data_ptr()


def test_an_fp32_packed_weight_is_the_packed_fp32_product_bit_for_bit():
    """One PackedWeight class, either kind: fp32 panels run kernels.cpp's product (bias after the chain)."""
    from decode.backends.cpu.kernels import kernel_ops

    fp32, kernels = kernel_ops()[0], native_kernels()[0]
    weight, bias, x = torch.randn(61, 48), torch.randn(61), torch.randn(9, 48)
    panels = fp32.pack(weight)
    assert torch.equal(kernels.packed_mm(x, kernels.PackedWeight(words=panels, n=61, bias=bias)),
                       fp32.linear(x, panels, 61, bias))
    with pytest.raises(RuntimeError, match="take no scales"):
        kernels.PackedWeight(words=panels, n=61, scales=torch.ones(8, 1, 8))


def test_prepare_gives_native_runners_and_leaves_the_model_as_it_was():
    from decode.backends import Backend, runs_natively
    from decode.chains.build import truncated_copy
    from decode.engine.levels import ModelLevel

    target = tiny_model(seed=9)
    prepared = Backend("avx2", native_fp32="on").prepare(target)
    assert runs_natively(prepared) and isinstance(prepared.new_runner(), NativeLlamaRunner)
    assert isinstance(ModelLevel("t", prepared).runner, NativeLlamaRunner)
    assert isinstance(ModelLevel("t", target).runner, HFRunner)  # the plain model runs as transformers does
    assert prepared.new_runner() is not prepared.new_runner()  # each level and reference has its own KV cache
    exit2 = Backend("avx2", native_fp32="on").prepare(truncated_copy(target, 2))
    with torch.no_grad():
        assert exit2.new_runner().forward(text(5), None, None).shape == (1, 5, 64)  # its own 2 layers
    assert exit2.model.model.layers[0].mlp.down_proj is target.model.layers[0].mlp.down_proj
    plain = Backend("avx2").prepare(tiny_model(seed=9))  # native "off" by default
    assert not runs_natively(plain) and isinstance(plain.new_runner(), HFRunner)


def test_no_backend_attribute_is_set_on_a_model_or_head():
    """The backend is a value: preparing a model or head (packed, native runner, int8 LM head, draft rows) swaps
    linears for packed ones at most; it adds no attribute to any module that existed before."""
    from decode.backends import Backend, with_lm_head
    from decode.backends.cpu.int8 import Int8RowLinear
    from heads.eagle import EagleHead

    target = tiny_model(seed=9)
    head = EagleHead.for_target(target, draft_vocab=torch.arange(0, 300, 3)).eval()
    before = {m: set(vars(m)) for module in (target, head) for m in module.modules()}  # keeps every module alive
    prepared = Backend("avx2", native_fp32="on", native_w4="on").prepare(target)
    with_lm_head(prepared, Int8RowLinear(target.lm_head))
    prepared_head = Backend("avx2", native_fp32="on").prepare_head(head)
    prepared_head.new_runner()
    assert prepared_head.lm_head is not None and prepared_head.lm_head.out_features == 100
    after = {m: set(vars(m)) for module in (target, head) for m in module.modules() if m in before}
    assert after == {key: before[key] for key in after}
    assert len(after) > 10  # the modules' own layers were compared, not only new ones


def test_models_it_cannot_run_are_refused_with_a_reason(capsys):
    from decode.backends.cpu.llama import native_fp32_runner

    bf16 = tiny_model(seed=10).to(torch.bfloat16)
    assert "float32" in unsupported(bf16)
    assert "packed for onednn" in unsupported(packed(tiny_model(seed=10), "onednn"))
    gelu = tiny_model(seed=10)
    gelu.config.hidden_act = "gelu"
    assert native_fp32_runner(gelu, "auto") is None
    assert "runs the HF forward (native runner: activation 'gelu'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="native_fp32=on: the native runner cannot run"):
        native_fp32_runner(gelu, "on")
    with pytest.raises(ValueError, match="cannot run this model"):
        NativeLlamaRunner(bf16)


def test_head_dims_attention_cannot_take_are_refused_before_the_decoder_is_built():
    """attend_views reads keys 8 floats at a time and trusts the shapes it is given: a head dim of 12 must never reach
    it (it would read past each head), neither through the Python check nor through the C++ constructor."""
    odd = tiny_model(seed=11, hidden=48)  # 4 heads of 12
    assert "head dim 12" in unsupported(odd)
    cos = sin = torch.zeros(16, 12)
    with pytest.raises(RuntimeError, match="head dims that are multiples of 8"):
        native_kernels()[0].Decoder(odd.get_input_embeddings().weight.detach(), None, cos, sin, 4, 2, 1e-5, 1)
    assert unsupported(tiny_model(seed=11, hidden=64)) is None  # 4 heads of 16


def test_decode_native_fp32_is_checked_and_off_without_fast():
    from omegaconf import OmegaConf

    from decode.engine.errors import DecodeError
    from decode.settings import backend_of, decode_section

    def backend(decode: dict):
        return backend_of(decode_section(OmegaConf.create({"decode": decode})), torch.device("cpu"))

    with pytest.raises(DecodeError, match="^decode.native_fp32 must be one of auto, on, off"):
        backend({"fast": True, "native_fp32": "yes"})
    assert backend({"fast": False, "native_fp32": "on"}).native_fp32 == "off"
    assert backend({"fast": True}).native_fp32 == "auto"


def test_the_autoregressive_reference_runs_the_configured_forward():
    """AR on a natively configured target: the tokens of a chain whose target level is native with nothing to
    verify, i.e. the native forward's own greedy tokens."""
    from decode.chains.baselines import autoregressive

    target = Backend("avx2", native_fp32="on").prepare(tiny_model(seed=11))
    prompt = text(10, seed=5)[0].tolist()
    runner, tokens = target.new_runner(), []
    with torch.no_grad():
        hidden = runner.forward(torch.tensor([prompt]), None, None)
        for _ in range(12):
            tokens.append(int(target.lm_head(hidden[:, -1]).argmax()))
            hidden = runner.forward(torch.tensor([[tokens[-1]]]), None, None)
    assert autoregressive(target, prompt, 12).tokens == tokens
    assert copy.deepcopy(target.model) is not None  # no native object on the model: it copies like any other
