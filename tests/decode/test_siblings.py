"""Sibling linears stacked (decode.backends.siblings), as the compiled static runners' models and heads run them: q/k/v
and gate/up of every layer become one product each (fewer products a forward, counted by torch.profiler as decode.costs
counts them), the model computes what it did (plain and int4pack linears, both heads), its state_dict is unchanged and
holds no second copy of the weights, a sibling called out of the traced order computes alone, and the stacked model
traces as one graph with the stacked products in it."""
from __future__ import annotations

import copy

import pytest
import torch
from decode_fixtures import tiny_model
from test_compiled_runner import HEADS, LIGHT, int4_model
from test_static_runner import VOCAB

from decode.backends import Backend
from decode.backends.siblings import SiblingLinear, stack_siblings
from decode.backends.static import CompiledHeadRunner, CompiledRunner
from infra.timing import launches

pytestmark = pytest.mark.usefixtures("one_thread")
LAYERS = 2
IDS = torch.tensor([[5, 9, 2, 7, 11, 3]])


def stacked(model: torch.nn.Module) -> tuple[torch.nn.Module, int]:
    copied = copy.deepcopy(model)
    return copied, stack_siblings(copied, lambda: copied(input_ids=IDS[:, :4], use_cache=False))


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=IDS, use_cache=False).logits


def products(model: torch.nn.Module) -> int:
    return launches(lambda k: logits(model), "cpu")["products"]


@pytest.mark.parametrize("make", [lambda: tiny_model(seed=0, vocab=VOCAB, layers=LAYERS),
                                  lambda: int4_model(hidden=128)], ids=["plain", "int4pack"])
def test_stacked_siblings_compute_the_same_model_in_fewer_products(make):
    model = make()
    fused, groups = stacked(model)
    assert groups == 2 * LAYERS
    assert (products(model), products(fused)) == (7 * LAYERS + 1, 4 * LAYERS + 1)  # the LM head: one more
    difference = (logits(fused) - logits(model)).abs().max().item()
    assert difference < 1e-5, difference


def test_int4_siblings_whose_packs_do_not_stack_stay_apart(monkeypatch):
    """An AVX-512 CPU int4 pack tiles 64 rows: k and v of 32 rows each stacked as packed computed another model
    (logits off by 3; an AVX2 pack stacks them). Planted on every host, a stack whose rows are out of place: the probe
    keeps every group apart and the model computes what it did."""
    import decode.backends.siblings as siblings

    model = int4_model(hidden=64)
    fused, groups = stacked(model)  # as this host's pack allows: gate/up at least (128 rows each)
    assert groups in (LAYERS, 2 * LAYERS) and products(fused) == 7 * LAYERS + 1 - (groups - LAYERS) * 2 - LAYERS
    assert (logits(fused) - logits(model)).abs().max().item() < 1e-5

    pack = siblings.Int4Pack
    monkeypatch.setattr(siblings, "Int4Pack", lambda weight, *rest: pack(weight.roll(1, 0), *rest))
    fused, groups = stacked(model)
    assert groups == 0 and products(fused) == 7 * LAYERS + 1
    assert (logits(fused) - logits(model)).abs().max().item() < 1e-5


def test_the_state_dict_is_unchanged_and_the_weights_are_not_copied():
    model = tiny_model(seed=0, vocab=VOCAB, layers=LAYERS)
    fused, _ = stacked(model)
    before, after = model.state_dict(), fused.state_dict()
    assert list(before) == list(after) and all(torch.equal(before[k], after[k]) for k in before)
    attention = fused.model.layers[0].self_attn
    group = attention.q_proj.sibling[0]
    start = group.run.weight.data_ptr()
    assert [m.weight.data_ptr() - start for m in (attention.q_proj, attention.k_proj, attention.v_proj)] == [
        bound * model.config.hidden_size * 4 for bound in group.bounds[:-1]]  # views of the stacked rows (fp32)


def test_a_sibling_called_out_of_the_traced_order_computes_alone():
    fused, _ = stacked(tiny_model(seed=0, vocab=VOCAB, layers=LAYERS))
    attention = fused.model.layers[0].self_attn
    assert isinstance(attention.k_proj, SiblingLinear)
    x, other = torch.randn(1, 3, fused.config.hidden_size), torch.randn(1, 3, fused.config.hidden_size)
    with torch.inference_mode():
        attention.q_proj(x)
        k = attention.k_proj(other)  # not the input q was handed: its own product, not q's slice for x
        v = attention.v_proj(x)
    assert torch.allclose(k, other @ attention.k_proj.weight.T, atol=1e-6)
    assert torch.allclose(v, x @ attention.v_proj.weight.T, atol=1e-6)


@pytest.mark.parametrize("kind", HEADS)
def test_a_compiled_heads_siblings_are_stacked_and_it_drafts_as_before(kind):
    """prepare_head on the compiled runners stacks the head's layer; its step computes what the plain head's does."""
    model = tiny_model(seed=0, vocab=VOCAB, layers=LAYERS)
    head = HEADS[kind](model).eval()
    prepared = Backend(runner="static").prepare_head(copy.deepcopy(head))
    assert sum(isinstance(m, SiblingLinear) for m in prepared.head.modules()) == 5  # q, k, v; gate, up
    features = torch.randn(1, 4, head.feature_size)
    with torch.inference_mode():
        plain = head(IDS[:, :4], features, compute_logits=False)[0]
    fused = CompiledHeadRunner(prepared.head, (4,), 64, backend=LIGHT).forward(IDS[:, :4], features, None, None)
    assert (fused - plain).abs().max().item() < 1e-5


def test_the_compiled_runners_models_run_stacked_products_only_there():
    """decode.backend=static stacks a model's siblings before its runners compile; the CPU's default does not (its
    packed linears fuse their own way)."""
    model = tiny_model(seed=0, vocab=VOCAB, layers=LAYERS)
    reference = logits(model)
    prepared = Backend(runner="static").prepare(copy.deepcopy(model))
    assert sum(isinstance(m, SiblingLinear) for m in prepared.model.modules()) == 5 * LAYERS
    assert not any(isinstance(m, SiblingLinear) for m in Backend().prepare(copy.deepcopy(model)).model.modules())
    runner = CompiledRunner(prepared.model, (8,), 64, backend=LIGHT)
    count = launches(lambda k: (runner.reset(), runner.forward(IDS, None, None)), "cpu")
    assert count["products"] == 4 * LAYERS  # the decoder's forward: no LM head
    runner.reset()
    with torch.inference_mode():
        difference = (prepared.model.lm_head(runner.forward(IDS, None, None)) - reference).abs().max().item()
    assert difference < 1e-4, difference


def test_a_stacked_int4pack_model_compiles_as_one_graph_and_computes_the_same():
    """The W4 level on torch's int4 kernel, stacked, on the compiled runner (fullgraph: a break raises)."""
    model = int4_model(hidden=128)
    fused, groups = stacked(model)
    assert groups == 2 * LAYERS
    runner = CompiledRunner(fused, (8,), 64, backend=LIGHT)
    count = launches(lambda k: (runner.reset(), runner.forward(IDS, None, None)), "cpu")
    assert count["products"] == 4 * LAYERS
    runner.reset()
    with torch.inference_mode():
        difference = (model.lm_head(runner.forward(IDS, None, None)) - logits(model)).abs().max().item()
    assert difference < 1e-4, difference
