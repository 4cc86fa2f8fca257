"""The W4 stage on every family polyspec promises (tests/family_models.py): the checkpoint loads back whole (every
quantized module filled from the tensors GPTQ computed, Phi-3's fused projections and the mixture-of-experts
families' routed experts included), a W4 chain decodes exactly like transformers' `generate`, and a checkpoint that
does not load whole is refused in one line naming the module. Phi-3 (the family whose projections GPTQModel splits)
and Mixtral (whose experts it quantizes one by one) run with the fast tests, the other families with the slow ones
(a stage each, ~10 s)."""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
from family_models import FAMILIES, tiny_family_model
from lossless_fixtures import greedy_equal
from safetensors.torch import load_file, save_file
from w4_fixtures import stage_config

from data.models import IncompleteCheckpointError, expert_name, load_model
from decode.engine.errors import DecodeError
from heads.eagle import routes_to_experts
from quantize.checkpoint import dequantize
from quantize.errors import QuantizeError
from quantize.settings import w4_of
from quantize.w4 import run

FAST = ("phi3", "mixtral")
# Quantized linears a layer where not q/k/v/o and gate/up/down: Phi-3's qkv_proj, o_proj, gate_up_proj, down_proj;
# GPT-NeoX's query_key_value, dense, dense_h_to_4h, dense_4h_to_h; four attention linears and each of four experts'
# gate/up/down (their routers stay full precision).
LINEARS_PER_LAYER = {"phi3": 4, "gpt_neox": 4, "mixtral": 16, "qwen3_moe": 16, "gpt_oss": 16}
NEW_TOKENS = 60


@dataclass(frozen=True)
class Quantized:
    family: str
    source: Path
    w4: Path


@pytest.fixture(scope="module")
def quantize_family(chat_file, tmp_path_factory) -> Callable[[str], Quantized]:
    """A family's tiny model and its W4 copy, made by the quantize.w4 stage once per module."""
    made: dict[str, Quantized] = {}

    def make(family: str) -> Quantized:
        if family not in made:
            root = tmp_path_factory.mktemp(family)
            source = tiny_family_model(family, root / "source")
            made[family] = Quantized(family, source, run(w4_of(stage_config(source, chat_file, root / "run"))))
        return made[family]

    return make


@pytest.fixture(scope="module", params=[pytest.param(f, marks=() if f in FAST else pytest.mark.slow)
                                        for f in FAMILIES])
def quantized(request, quantize_family) -> Quantized:
    return quantize_family(request.param)


@pytest.fixture
def phi3(quantize_family) -> Quantized:
    return quantize_family("phi3")


@pytest.fixture
def mixtral(quantize_family) -> Quantized:
    return quantize_family("mixtral")


def stored(folder: Path) -> dict[str, torch.Tensor]:
    return {key: value for f in sorted(folder.glob("*.safetensors")) for key, value in load_file(f).items()}


def loaded_names(tensors: dict[str, torch.Tensor], model_type: str) -> dict[str, torch.Tensor]:
    """The tensors under the names the family's class loads (Mixtral's experts are stored as vLLM loads them)."""
    return {expert_name(key, model_type): value for key, value in tensors.items()}


def test_the_w4_model_loads_back_whole_with_the_weights_gptq_computed(quantized):
    """Every linear transformers quantizes on load is filled from the checkpoint, under the name the family's class
    loads: the W4 model computes what the source model computes with each linear's dequantized stored weights (the
    CPU kernel rounds its activations to bf16), at every position (mixture-of-experts: at nine in ten). A module
    left at its random init is far off."""
    import defuser

    w4, _ = load_model(str(quantized.w4))
    reference, _ = load_model(str(quantized.source))
    if routes_to_experts(reference):  # experts as linears, each to take its dequantized weight
        defuser.convert_model(reference, cleanup_original=True)
    tensors = loaded_names(stored(quantized.w4), w4.config.model_type)
    prefixes = sorted(key.removesuffix(".qweight") for key in tensors if key.endswith(".qweight"))
    loaded = sorted(name for name, module in w4.named_modules() if type(module).__name__ == "TorchFusedLinear")
    per_layer = LINEARS_PER_LAYER.get(quantized.family, 7)
    assert prefixes == loaded and len(loaded) == per_layer * w4.config.num_hidden_layers
    for prefix in prefixes:
        parts = (tensors[f"{prefix}.{part}"] for part in ("qweight", "qzeros", "scales", "g_idx"))
        reference.get_submodule(prefix).weight.data.copy_(dequantize(*parts, bits=4).t())
    ids = torch.randint(0, w4.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = w4(ids).logits, reference(ids).logits
    close = (got - want).abs().amax(-1) < 0.05 * want.abs().max()  # per position
    # A router picks experts by a margin the bf16 activations may cross: a position routed apart is far off, while a
    # module at its random init (or an expert's) is off at most positions. No argmax check: within this bound the
    # picks differ only at the tiny random models' near-ties, which bf16 rounding flips more or less often by CPU
    # kind (gpt-oss: at most 4 of 40 positions on SPR, 5 on Zen 4).
    assert close.float().mean() >= (0.9 if routes_to_experts(w4) else 1.0)


def w4_chain(quantized: Quantized, runner: str, native_w4: str) -> tuple[object, object]:
    """target <- W4 <- prompt lookup (conf's w4_lookup) on the family's target as the apps prepare it under
    `decode.backend=runner` and `decode.native=native_w4`, and its greedy generation, checked equal to transformers'
    own `generate` on the plain model (its near-ties excused, at most one)."""
    from decode.backends import Backend, runs_natively
    from decode.chains.build import ChainBuilder, LevelSettings
    from decode.engine.spec import ChainSpec

    model, tokenizer = load_model(str(quantized.source))
    body = torch.randint(0, model.config.vocab_size, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    prompt = body + body[:4] + body
    with torch.no_grad():
        reference = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    target = Backend("auto", native_fp32="auto", runner=runner).prepare(model)
    gemm = "avx2" if runner != "eager" or runs_natively(target) else None
    backend = Backend(gemm, native_w4=native_w4, runner=runner)
    chain = ChainBuilder(target, tokenizer, settings=LevelSettings(backend=backend)).build(ChainSpec.parse([
        {"kind": "model"}, {"kind": "model", "name": "w4", "model": str(quantized.w4), "mu": 4, "lm_head": "int8"},
        {"kind": "ngram", "max_ngram": 3, "draft": {"mode": "chain", "length": 4}}]))
    generation = chain.generate(prompt, NEW_TOKENS, eos_token_id=tokenizer.eos_token_id)
    ok, ties = greedy_equal(target, prompt, generation.tokens, ref=reference[0, len(prompt):].tolist())
    assert ok and ties <= 1, f"{quantized.family}: the W4 chain's output differs from transformers' generate"
    assert generation.stats.levels[1].forward_calls > 0  # the W4 level verified drafts
    return chain, generation


def test_a_w4_chain_decodes_exactly_like_transformers_generate(quantized):
    """Under `decode.backend=eager`: native where it runs, else transformers' forward."""
    w4_chain(quantized, "eager", "off")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["phi3", "qwen3_moe"])
def test_under_auto_a_w4_level_the_native_runner_declines_runs_ahead_of_time_on_the_int4_tiles(quantize_family,
                                                                                                family):
    """Phi-3 (projections GPTQModel split, stacked again): target and W4 level on the compiled runner, compiled by
    AOTInductor, the W4 level's linears on the project's int4 tiles. Qwen3-MoE's W4 level (each expert's linears
    apart, run in a loop over the experts routed to, which no graph captures) stays on transformers' forward."""
    from decode.backends.cpu.llama import NativeInt8Linear
    from decode.backends.cuda.runner import on_kernels
    from decode.backends.static import CompiledRunner
    from decode.engine.runner import HFRunner

    chain, _ = w4_chain(quantize_family(family), "auto", "auto")
    target, w4 = chain.levels[:2]
    assert isinstance(target.runner, CompiledRunner)
    assert isinstance(w4.runner, CompiledRunner if family == "phi3" else HFRunner) and on_kernels(w4.model) == (
        family == "phi3")
    assert isinstance(w4.lm_head, NativeInt8Linear) == (family == "phi3")  # lm_head: int8 on the native kernel


def test_phi3_fused_projections_are_stored_whole(phi3):
    """Phi-3's class loads gate_up_proj and qkv_proj; GPTQModel quantizes gate_up_proj as gate_proj and up_proj."""
    keys = stored(phi3.w4)
    assert "model.layers.0.mlp.gate_up_proj.qweight" in keys and "model.layers.0.self_attn.qkv_proj.qweight" in keys
    assert not any(".gate_proj." in key or ".up_proj." in key for key in keys)


def test_routed_experts_are_stored_one_linear_each_and_loaded_so(mixtral):
    """GPTQModel quantizes each expert's gate/up/down as a linear of its own; transformers' Mixtral holds them fused.
    The checkpoint stores them one by one under Mixtral's original names (w1 gate, w3 up, w2 down: what vLLM's Mixtral
    loads) and load_model builds the experts as linears for it."""
    keys = stored(mixtral.w4)
    assert "model.layers.0.block_sparse_moe.experts.3.w2.qweight" in keys
    assert "model.layers.0.block_sparse_moe.gate.weight" in keys
    assert not any(".mlp." in key or key.endswith(("gate_up_proj", "down_proj")) for key in keys)
    w4, _ = load_model(str(mixtral.w4))
    assert type(w4.get_submodule("model.layers.2.mlp.experts.3.up_proj")).__name__ == "TorchFusedLinear"


def test_quantizing_leaves_transformers_classes_as_transformers_defines_them(mixtral):
    """GPTQModel's loader swaps transformers' Mixtral block for a defused one process-wide (and wraps the checkpoint
    renaming): the stage puts both back, so that its own check of what it wrote, and every later load in the process,
    builds the model as decode does in a fresh process. Planted: quantize.gptq.transformers_as_defined doing
    nothing leaves defuser's block in transformers' module."""
    from transformers import conversion_mapping
    from transformers.models.mixtral import modeling_mixtral

    assert mixtral.w4.exists()
    assert modeling_mixtral.MixtralSparseMoeBlock.__module__ == modeling_mixtral.__name__
    assert conversion_mapping.get_checkpoint_conversion_mapping.__module__ == conversion_mapping.__name__
    source, _ = load_model(str(mixtral.source))
    assert type(source.model.layers[0].mlp).__module__ == modeling_mixtral.__name__


def test_the_stage_refuses_a_checkpoint_that_does_not_load_back(chat_file, tmp_path, monkeypatch):
    """Planted: the stage saves Phi-3's projections as GPTQModel splits them (the old behaviour). It stops in one
    line naming the module before measuring or writing anything."""
    import quantize.w4 as w4

    monkeypatch.setattr(w4, "fuse_split_projections", lambda folder, linears: [])
    source = tiny_family_model("phi3", tmp_path / "source")
    with pytest.raises(QuantizeError, match=r"does not load back whole.*module model\.layers\.0\.mlp\.gate_up_proj") \
            as err:
        run(w4_of(stage_config(source, chat_file, tmp_path / "run")))
    assert "\n" not in str(err.value)
    assert not (tmp_path / "run" / "w4").exists() and not list((tmp_path / "run").glob(".w4.*"))


def test_a_checkpoint_missing_a_tensor_is_refused_by_its_readers(phi3, tmp_path):
    """Planted: one tensor deleted from a saved W4 model. Loading it (every reader of a W4 folder goes through
    load_model: decode's chains, train.eagle, decode.costs, decode.interop) fails in one line naming the module."""
    from transformers import AutoTokenizer

    from decode.chains.build import ChainBuilder
    from decode.engine.spec import ChainSpec

    broken = shutil.copytree(phi3.w4, tmp_path / "w4")
    file = broken / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.down_proj.scales"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(IncompleteCheckpointError, match=r"no tensors for module model\.layers\.1\.mlp\.down_proj ") \
            as err:
        load_model(str(broken))
    assert "\n" not in str(err.value)
    target, _ = load_model(str(phi3.source))
    builder = ChainBuilder(target, AutoTokenizer.from_pretrained(broken))
    with pytest.raises(DecodeError, match=r"level 'w4': .*module model\.layers\.1\.mlp\.down_proj "):
        builder.build(ChainSpec.parse([{"kind": "model"}, {"kind": "model", "name": "w4", "model": str(broken),
                                                           "draft": {"mode": "chain", "length": 2}}]))


def test_a_group_size_the_kernels_cannot_store_is_refused_before_any_model_loads(tiny_source, chat_file, tmp_path,
                                                                                 monkeypatch):
    """The tiny Llama's linear inputs are 192 and 384 wide: 40-wide groups leave 8-column stored groups."""
    import quantize.w4 as w4

    def refused(*args, **kwargs):
        raise AssertionError("a model was loaded before quantize.group_size was checked")

    monkeypatch.setattr(w4, "load_model", refused)
    with pytest.raises(QuantizeError, match=r"^quantize\.group_size=40 .* widths \[192, 384\]; set it to a multiple "
                                            r"of 64$"):
        run(w4_of(stage_config(tiny_source, chat_file, tmp_path, group_size=40)))
