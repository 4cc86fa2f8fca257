"""An EAGLE-2 head on the native runner (decode/backends/cpu/eagle_head.py): the head's own function up to rounding,
row-exact (k tokens, or a tree depth, in one call give the bits of one-token forwards), rolled back by length, chosen
by the backend wherever fp32 models may run natively, and refused with a reason where it cannot run. The chains it
drafts for stay lossless: tests/decode/test_lossless_greedy.py and test_sampling_distribution.py run every EAGLE shape
with it (their "native" models)."""
from __future__ import annotations

import pytest
import torch
from decode_fixtures import tiny_model

from decode.backends import Backend
from decode.backends.cpu.eagle_head import NativeHeadRunner, head_unsupported, int8_problem, native_head_runners
from decode.backends.cpu.llama import NativeInt8Linear, native_kernels
from decode.backends.static import CompiledHeadRunner
from decode.engine.runner import HFHeadRunner
from decode.engine.tree import Tree
from heads.eagle import EagleHead
from heads.eagle3 import Eagle3Head

pytestmark = [pytest.mark.skipif(native_kernels()[0] is None, reason="the native kernels do not build here"),
              pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def head():
    """A head of a packed tiny target (what Backend.prepare_head makes of one), large-valued weights so that
    differences show."""
    torch.manual_seed(0)
    target = tiny_model(seed=12)
    return Backend("avx2", native_fp32="auto").prepare_head(EagleHead(target, init_std=0.2).eval()).head


def inputs(n: int, seed: int = 0, hidden: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 300, (1, n), generator=gen), torch.randn(1, n, hidden, generator=gen)


def close(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    """Equal up to float32 rounding at the scale of the states (the large-valued head makes them large): norms, rotary
    and sums round differently on the native layer and on either CPU kind; a wrong position, mask or cache row
    differs by O(1)."""
    return bool((ours - theirs).abs().max() <= 1e-5 * theirs.abs().max())


def test_the_forward_is_the_heads_own_up_to_rounding(head):
    (ids, feats), reference, runner = inputs(40), HFHeadRunner(head), native_head_runners(head)()
    assert isinstance(runner, NativeHeadRunner)
    for lo, hi in ((0, 30), (30, 31), (31, 40)):  # the context's real features, one draft step, a longer step
        with torch.no_grad():
            ours = runner.forward(ids[:, lo:hi], feats[:, lo:hi], None, None)
            theirs = reference.forward(ids[:, lo:hi], feats[:, lo:hi], None, None)
        assert close(ours, theirs), (lo, (ours - theirs).abs().max(), theirs.abs().max())
    assert runner.cached() == reference.cached() == 40


def test_a_forward_of_k_tokens_gives_the_bits_of_k_one_token_forwards_after_a_rollback(head):
    """A rollback is a length: cropping to 12 and feeding the same rows again gives the same bits, one at a time or
    together, whatever the thread count."""
    (ids, feats), runner = inputs(20, seed=1), native_head_runners(head)()
    runner.forward(ids[:, :12], feats[:, :12], None, None)
    together = runner.forward(ids[:, 12:], feats[:, 12:], None, None)
    runner.crop(12)
    alone = torch.cat([runner.forward(ids[:, i:i + 1], feats[:, i:i + 1], None, None) for i in range(12, 20)], 1)
    assert torch.equal(together, alone)
    torch.set_num_threads(2)
    runner.crop(12)
    assert torch.equal(runner.forward(ids[:, 12:], feats[:, 12:], None, None), together)
    assert runner.cached() == 20


def test_on_int8_rows_the_forward_is_row_exact_and_near_the_heads_own(head):
    """`weights: int8`: the head's fc and layer on int8 rows. A forward of k tokens gives the bits of k one-token
    forwards at any thread count (the W4 level's exactness contract), and stays near the fp32 function: on this
    large-valued head int8 rows and activations move the states by 4-14% of their scale (four inputs), a lost cache
    row by 89-104%."""
    (ids, feats), runner = inputs(20, seed=5), native_head_runners(head, int8=True)()
    reference = native_head_runners(head)()
    assert isinstance(runner.fc, NativeInt8Linear)
    assert runner.streamed_bytes() < 0.3 * reference.streamed_bytes()
    together = runner.forward(ids, feats, None, None)
    runner.crop(12)
    alone = torch.cat([runner.forward(ids[:, i:i + 1], feats[:, i:i + 1], None, None) for i in range(12, 20)], 1)
    assert torch.equal(together[:, 12:], alone)
    torch.set_num_threads(3)
    runner.crop(12)
    assert torch.equal(runner.forward(ids[:, 12:], feats[:, 12:], None, None), alone)
    fp32 = reference.forward(ids, feats, None, None)
    error = (together - fp32).abs().max() / fp32.abs().max()
    assert 0 < error < 0.3, error


def test_the_backend_puts_a_head_on_int8_rows_only_where_it_runs_natively(capsys):
    target = tiny_model(seed=15)
    head = EagleHead.for_target(target, draft_vocab=torch.arange(0, 200, 3)).eval()
    prepared = Backend("avx2", native_fp32="on").prepare_head(head, "int8")
    assert isinstance(prepared.new_runner().fc, NativeInt8Linear) and isinstance(prepared.lm_head, NativeInt8Linear)
    assert prepared.lm_head.out_features == len(head.draft_vocab)
    plain = Backend("avx2", native_fp32="off").prepare_head(EagleHead.for_target(target).eval(), "int8")
    assert isinstance(plain.new_runner(), HFHeadRunner) and not isinstance(plain.lm_head, NativeInt8Linear)
    assert "weights: int8 runs on the native head runner only" in capsys.readouterr().err
    ragged = EagleHead.for_target(target).eval()  # fc reads 2 x 64; a layer of 72 inputs cannot run on int8 rows
    ragged.layer.mlp.down_proj = torch.nn.Linear(72, 64, bias=False)
    ragged.layer.mlp.gate_proj, ragged.layer.mlp.up_proj = torch.nn.Linear(64, 72, bias=False), torch.nn.Linear(
        64, 72, bias=False)
    assert int8_problem(ragged) == "layers.0.mlp.down_proj reads 72 inputs, not a multiple of 16"
    kept = Backend("avx2", native_fp32="on").prepare_head(ragged, "int8")
    assert not isinstance(kept.new_runner().fc, NativeInt8Linear)
    assert "keeps its own weights" in capsys.readouterr().err


def test_a_tree_depth_under_its_mask_gives_the_bits_of_its_path(head):
    """Tree nodes 5 -> {9, 7}, 7 -> 11 fed in one call under the tree's mask and positions: the rows of the path 5,
    7, 11 are the bits of feeding the path alone, and agree with the head's own forward under the same mask."""
    (context, feats), runner, reference = inputs(12, seed=2), native_head_runners(head)(), HFHeadRunner(head)
    tree = Tree()
    for token, parent in ((5, -1), (9, 0), (7, 0), (11, 2)):
        tree.add(token, parent)
    mask, positions = tree.attention_mask(12, 12, torch.float32), tree.position_ids(12, 12)
    node_feats = inputs(4, seed=3)[1]
    results = []
    for r in (runner, reference):
        with torch.no_grad():
            r.forward(context, feats, None, None)
            results.append(r.forward(torch.tensor([tree.tokens]), node_feats, mask, positions))
    runner.crop(12)
    path = torch.cat([runner.forward(torch.tensor([[t]]), node_feats[:, [i]], None, None)
                      for i, t in ((0, 5), (2, 7), (3, 11))], dim=1)
    assert torch.equal(results[0][:, [0, 2, 3]], path)
    assert close(results[0], results[1])


def test_the_backend_runs_a_head_natively_where_fp32_models_may_and_says_why_not(capsys):
    target = tiny_model(seed=13)
    for native, expected in (("auto", NativeHeadRunner), ("on", NativeHeadRunner), ("off", HFHeadRunner)):
        head = EagleHead.for_target(target).eval()
        assert isinstance(Backend("avx2", native_fp32=native).prepare_head(head).new_runner(), expected), native
    assert isinstance(Backend(None, native_fp32="auto").prepare_head(EagleHead.for_target(target)).new_runner(),
                      HFHeadRunner)  # nothing packed: the head's own forward, as a target's
    eagle3 = Eagle3Head.for_target(target).eval()  # under auto: the compiled head runner, ahead of time
    factory = Backend("avx2", native_fp32="auto").prepare_head(eagle3).new_runner
    assert factory.func is CompiledHeadRunner and factory.keywords == {"backend": "aoti"}
    assert "the draft head runs the compiled runner, ahead of time (native runner: method 'eagle3'" in \
        capsys.readouterr().err
    eager = Backend("avx2", native_fp32="auto", runner="eager")
    assert isinstance(eager.prepare_head(Eagle3Head.for_target(target).eval()).new_runner(), HFHeadRunner)
    assert "the draft head runs its own forward (native runner: method 'eagle3'" in capsys.readouterr().err


def test_heads_it_cannot_run_are_refused_with_a_reason():
    target = tiny_model(seed=14)
    assert "method 'eagle3'" in head_unsupported(Eagle3Head.for_target(target))
    assert "float32" in head_unsupported(EagleHead.for_target(target).to(torch.bfloat16))
    gelu = EagleHead.for_target(target)
    gelu.config.hidden_act = "gelu"
    assert "activation 'gelu'" in head_unsupported(gelu)
    with pytest.raises(ValueError, match="cannot run this head"):
        native_head_runners(gelu)
    with_norm = EagleHead.for_target(target)
    with_norm.layer.input_layernorm = torch.nn.LayerNorm(64)
    assert "input norm" in head_unsupported(with_norm)


def test_the_cache_refuses_positions_past_its_capacity(head):
    runner = NativeHeadRunner(head, native_head_runners(head).args[1], capacity=8)
    ids, feats = inputs(9, seed=4)
    runner.forward(ids[:, :8], feats[:, :8], None, None)
    with pytest.raises(ValueError, match="holds 8 positions; 9 asked"):
        runner.forward(ids[:, 8:], feats[:, 8:], None, None)
