"""The W4 stage: error paths, atomic output, group-size metadata, and loading the checkpoint back.

Fast tests quantize a tiny random Llama (hidden 192, so most inputs are not a multiple of 128, like
SmolLM2's 576) once per module; the slow test quantizes the real bundled model with reduced settings."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from w4_fixtures import stage_config

from quantize.checkpoint import dequantize, split_groups, storage_group_size
from quantize.errors import QuantizeError
from quantize.evaluation import acceptance_lengths
from quantize.settings import w4_of
from quantize.w4 import run

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def quantized(tiny_source, chat_file, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("run")
    return run(w4_of(stage_config(tiny_source, chat_file, run_dir)))


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(".w4.")]


def test_output_is_complete_with_metrics_and_no_temp_dirs(quantized):
    metrics = json.loads((quantized / "metrics.json").read_text())
    for key in (
        "ppl_target", "ppl_w4", "greedy_agreement", "acceptance_length_m1_m2", "forward_ms_target_1tok",
        "forward_ms_w4_1tok", "forward_ms_target_8tok", "forward_ms_w4_8tok", "size_mb_target", "size_mb_w4",
        "quantize_s",
    ):
        assert metrics[key] > 0, key
    assert 0 <= metrics["greedy_agreement"] <= 1
    assert 1 <= metrics["acceptance_length_m1_m2"] <= metrics["draft_depth"] + 1
    assert not leftovers(quantized.parent)


def test_ragged_group_handling_is_recorded_in_the_checkpoint(quantized):
    quant = json.loads((quantized / "config.json").read_text())["quantization_config"]
    groups = quant["meta"]["polyspec"]["groups"]
    assert quant["bits"] == 4 and quant["sym"] is True
    assert groups["quantized_group_size"] == 128
    assert groups["stored_group_size"] == quant["group_size"] == 64
    assert groups["handling"] == "ragged last group"
    assert groups["ragged_modules"] == 12 and groups["quantized_modules"] == 14  # q,k,v,o,gate,up of 2 layers
    assert json.loads((quantized / "quantize_config.json").read_text())["group_size"] == 64
    # the default layout vLLM loads (g_idx dropped)
    assert quant["desc_act"] is False and groups["static_g_idx"] is True
    assert "ragged last group" in json.loads((quantized / "metrics.json").read_text())["group_handling"]


def test_stored_scales_repeat_each_128_wide_group(quantized):
    from safetensors.torch import load_file

    tensors = load_file(quantized / "model.safetensors")
    scales = tensors["model.layers.0.self_attn.q_proj.scales"]  # in_features 192: groups 128 + 64, stored as 3 x 64
    assert scales.shape[0] == 3
    assert torch.equal(scales[0], scales[1])


def test_plain_transformers_loads_and_generates(quantized):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(quantized)
    out = model.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert out.shape == (1, 10)


def test_load_model_gives_an_hf_model_the_chain_can_use(quantized):
    """The fast CPU kernel path: DynamicCache cropping and hidden states work like a full-precision level."""
    from transformers import AutoModelForCausalLM, DynamicCache

    from data.models import load_model

    model, tokenizer = load_model(str(quantized))
    assert type(model).__name__ == "LlamaForCausalLM"
    assert any(type(m).__name__ == "TorchFusedLinear" for m in model.modules())
    ids = torch.tensor([list(range(10, 30))])
    with torch.no_grad():
        full = model(ids, output_hidden_states=True)
        cache = DynamicCache(config=model.config)
        model(ids[:, :15], past_key_values=cache, use_cache=True)
        model(ids[:, 15:], past_key_values=cache, use_cache=True)
        cache.crop(-5)
        assert cache.get_seq_length() == 15
        step = model(ids[:, 15:], past_key_values=cache, use_cache=True)
        plain = AutoModelForCausalLM.from_pretrained(quantized)(ids).logits
    assert len(full.hidden_states) == model.config.num_hidden_layers + 1
    assert torch.allclose(step.logits[0], full.logits[0, 15:], atol=5e-2)  # the kernel computes in bf16
    assert (full.logits.argmax(-1) == plain.argmax(-1)).float().mean() > 0.9


def test_existing_output_needs_overwrite(quantized, tiny_source, chat_file):
    before = (quantized / "model.safetensors").stat().st_mtime_ns
    with pytest.raises(QuantizeError, match="already exists.*overwrite=true"):
        run(w4_of(stage_config(tiny_source, chat_file, quantized.parent)))
    assert (quantized / "model.safetensors").stat().st_mtime_ns == before


def test_skip_if_valid_keeps_a_matching_output(quantized, tiny_source, chat_file):
    before = (quantized / "model.safetensors").stat().st_mtime_ns
    assert run(w4_of(stage_config(tiny_source, chat_file, quantized.parent, skip_if_valid=True))) == quantized
    assert (quantized / "model.safetensors").stat().st_mtime_ns == before
    with pytest.raises(QuantizeError, match="already exists"):  # other settings: not valid, not silently replaced
        run(w4_of(stage_config(tiny_source, chat_file, quantized.parent, skip_if_valid=True, damp_percent=0.1)))


def test_overwrite_replaces_the_output(tiny_source, chat_file, tmp_path):
    out = run(w4_of(stage_config(tiny_source, chat_file, tmp_path)))
    (out / "stale").write_text("from the old run")
    assert run(w4_of(stage_config(tiny_source, chat_file, tmp_path, overwrite=True))) == out
    assert not (out / "stale").exists() and (out / "metrics.json").exists()
    assert not leftovers(tmp_path)


def test_quantized_input_is_refused(quantized, chat_file, tmp_path):
    with pytest.raises(QuantizeError, match="already quantized"):
        run(w4_of(stage_config(quantized, chat_file, tmp_path)))
    assert not (tmp_path / "w4").exists()


def test_too_few_calibration_samples_is_an_error(tiny_source, chat_file, tmp_path):
    with pytest.raises(QuantizeError, match="asked for 500 samples.*only"):
        run(w4_of(stage_config(tiny_source, chat_file, tmp_path, **{"calibration.samples": 500})))
    assert not (tmp_path / "w4").exists() and not leftovers(tmp_path)


def test_a_failure_after_quantizing_leaves_nothing_behind(tiny_source, chat_file, tmp_path, monkeypatch):
    import quantize.w4 as w4

    def broken(*args, **kwargs):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(w4, "evaluate_w4", broken)
    with pytest.raises(RuntimeError, match="interrupted"):
        run(w4_of(stage_config(tiny_source, chat_file, tmp_path)))
    assert not (tmp_path / "w4").exists() and not leftovers(tmp_path)


def test_a_checkpoint_with_a_nan_is_refused_naming_the_tensor(tiny_source, chat_file, tmp_path, monkeypatch):
    """Planted: GPTQ writes a NaN scale. The stage stops in one line naming the tensor, before measuring or writing
    anything."""
    from safetensors.torch import load_file, save_file

    import quantize.w4 as w4

    quantize = w4.gptq_quantize

    def with_a_nan(src, dst, *args, **kwargs):
        quantize(src, dst, *args, **kwargs)
        file = dst / "model.safetensors"
        tensors = load_file(file)
        tensors["model.layers.1.mlp.up_proj.scales"][0, 3] = float("nan")
        save_file(tensors, file, metadata={"format": "pt"})

    monkeypatch.setattr(w4, "gptq_quantize", with_a_nan)
    monkeypatch.setattr(w4, "evaluate_w4", lambda *args, **kwargs: pytest.fail("a non-finite model was measured"))
    with pytest.raises(QuantizeError, match=r"non-finite values in model\.layers\.1\.mlp\.up_proj\.scales, so nothing "
                                            r"is written") as err:
        run(w4_of(stage_config(tiny_source, chat_file, tmp_path)))
    assert "\n" not in str(err.value)
    assert not (tmp_path / "w4").exists() and not leftovers(tmp_path)


def test_missing_model_is_a_one_line_cli_error(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "quantize.w4", "~train", "~decode", "~eval", f"run_dir={tmp_path}",
         f"model.name={tmp_path}/nope"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "WANDB_MODE": "disabled"},
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == f"error: {tmp_path}/nope: no such model folder"
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "w4").exists()


def test_split_groups_is_lossless_for_activation_order_and_ragged_tails():
    """desc_act stores permuted group indices; re-encoding 128-wide groups as 64-wide ones keeps every weight."""
    torch.manual_seed(0)
    in_features, out_features, bits = 320, 16, 4  # 2 x 128 + a ragged 64
    g_idx = (torch.arange(in_features, dtype=torch.int32) // 128)[torch.randperm(in_features)]
    codes = torch.randint(0, 16, (in_features, out_features), dtype=torch.int32)
    qweight = sum(codes[i::8] << (4 * i) for i in range(8))
    zcodes = torch.randint(0, 15, (3, out_features), dtype=torch.int32)
    qzeros = sum(zcodes[:, i::8] << (4 * i) for i in range(8))
    scales = torch.rand(3, out_features, dtype=torch.float16) + 0.1
    before = dequantize(qweight, qzeros, scales, g_idx, bits)
    assert torch.equal(before, scales.float()[g_idx.long()] * (codes - zcodes[g_idx.long()] - 1).float())
    new = split_groups(g_idx, 128, 64)
    assert torch.bincount(new).tolist() == [64] * 5
    rows = torch.arange(5) // 2
    assert torch.equal(before, dequantize(qweight, qzeros[rows], scales[rows], new, bits))


def test_static_groups_tells_activation_order_from_the_static_layout(tmp_path):
    from safetensors.torch import save_file

    from quantize.checkpoint import static_groups

    static = torch.arange(192, dtype=torch.int32) // 64
    save_file({"a.g_idx": static, "b.g_idx": static[:128].clone()}, tmp_path / "model.safetensors")
    assert static_groups(tmp_path, 64) and not static_groups(tmp_path, 32)
    save_file({"a.g_idx": static[torch.randperm(192)]}, tmp_path / "model-2.safetensors")
    assert not static_groups(tmp_path, 64)


def test_storage_group_size():
    assert storage_group_size(128, [576, 576, 1536]) == 64
    assert storage_group_size(128, [1536, 256]) == 128


def test_acceptance_lengths_follow_greedy_verification():
    # a draft of depth 3: rounds accept the run of matches (capped at 3) plus the verifier's own token
    matches = [True, True, False, True, True, True, True, False, False, True, True, True]
    assert acceptance_lengths(matches, 3) == [3, 4, 1, 1]
    assert acceptance_lengths([True] * 20, 8) == [9, 9]


@pytest.mark.slow
def test_bundled_model_quantizes_and_the_w4_level_is_close(bundled_w4):
    """The real SmolLM2 with reduced settings (tests/conftest.py): quantized, re-encoded, measured."""
    out = bundled_w4
    metrics = json.loads((out / "metrics.json").read_text())
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quant["meta"]["polyspec"]["groups"]["ragged_modules"] == 30 * 6  # every module with a 576-wide input
    assert quant["group_size"] == 64 and quant["meta"]["polyspec"]["groups"]["quantized_group_size"] == 128
    assert quant["desc_act"] is False and quant["meta"]["polyspec"]["groups"]["static_g_idx"] is True
    # 4 bits on a 135M model: a loose sanity bound, the full run reports the real figure
    assert metrics["ppl_ratio"] < 1.5
    assert metrics["greedy_agreement"] > 0.5
    assert metrics["size_mb_w4"] < 0.5 * metrics["size_mb_target"]


def test_packed_int4_forward_matches_gptqmodels_own(quantized):
    """decode.backends.cpu.pack gives the int4 linears a lean forward: the same logits within bf16 rounding, and
    unpack undoes it exactly. Packing also swaps the dense linears and attention for the project's kernels, whose
    fp32 sums run in another order than torch's on some CPUs (Sapphire Rapids): that can flip the bf16 rounding of
    an int4 linear's input or output, so the packed side is held to a bound from that arithmetic, not to bit
    identity; unpacked, both sides run torch's own kernels and must agree bit for bit."""
    from transformers import DynamicCache

    from data.models import load_model
    from decode.backends.cpu import pack, unpack

    model, _ = load_model(str(quantized))
    ids = torch.tensor([list(range(10, 40))])
    with torch.no_grad():
        own = model(ids).logits
        int4 = [m for m in model.modules() if type(m).__name__ == "TorchFusedLinear"]
        assert pack(model) >= len(int4) > 0
        assert all("forward" in vars(m) for m in int4)
        lean = model(ids).logits
        cache = DynamicCache(config=model.config)
        model(ids[:, :20], past_key_values=cache, use_cache=True)
        step = model(ids[:, 20:], past_key_values=cache, use_cache=True).logits
        unpack(model)
        assert not any("forward" in vars(m) or m.sibling is not None for m in int4)
        again = model(ids).logits
    assert torch.equal(again, own)
    tolerance = bf16_rounding_bound(own, model.config.num_hidden_layers)
    assert (lean - own).abs().max() <= tolerance
    assert (step[0] - own[0, 20:]).abs().max() <= tolerance


def bf16_rounding_bound(logits: torch.Tensor, layers: int) -> float:
    """How far two correct int4 forwards may part: each layer's four int4 linears in series (q/k/v, o, gate/up,
    down) round input and output to bf16 (2**-8 relative), one ulp of the logits' scale per rounding; a wrong group
    size, act-order index or bias moves the logits by their own scale, far beyond it."""
    return 2 * 4 * layers * 2.0 ** -8 * logits.abs().max().item()
