"""The W4 level as a Q4_0 GGUF (decode/engines/llamacpp.py): exact where GPTQ is symmetric without act order,
refused in one line elsewhere; the written file keeps the target's metadata and norms, its embedding in Q8_0.
Synthetic GPTQ layers and a tiny target GGUF: no model, no llama.cpp build."""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from decode.engines.llamacpp import GgufExportError, GptqLinear, export_w4, q4_0_rows, rope_row_order
from quantize.checkpoint import dequantize


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """GPTQ's packing, the inverse of quantize.w4.unpack_rows: 8 codes per int32 along dim 0."""
    words = codes.long().view(-1, 8, *codes.shape[1:])
    shifts = torch.arange(0, 32, 4).view(1, 8, *([1] * (codes.dim() - 1)))
    return (words << shifts).sum(1).to(torch.int32)


def gptq_linear(n_in: int, n_out: int, group: int, seed: int = 0, zero: int = 8) -> GptqLinear:
    """A random symmetric GPTQ linear (v1: stored zeros are zero - 1) with fp16 scales."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n_in, n_out), generator=gen)
    groups = -(-n_in // group)
    zeros = torch.full((n_out, groups), zero - 1)
    scales = (torch.rand(groups, n_out, generator=gen) * 0.02 + 1e-3).to(torch.float16)
    g_idx = (torch.arange(n_in) // group).to(torch.int32)
    qzeros = pack_codes(zeros).t().contiguous()
    return GptqLinear("model.layers.0.mlp.down_proj", pack_codes(codes), qzeros, scales, g_idx)


def reference(linear: GptqLinear) -> np.ndarray:
    """The [out, in] weight the GPTQ checkpoint stands for, as polyspec dequantizes it."""
    return dequantize(linear.qweight, linear.qzeros, linear.scales, linear.g_idx, 4).t().contiguous().numpy()


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("group", [32, 64, 128])
def test_q4_0_dequantizes_to_the_gptq_weight_bit_for_bit(group):
    linear = gptq_linear(192, 24, group)
    rows = q4_0_rows(linear)
    assert rows.dtype == np.uint8 and rows.shape == (24, 192 // 32 * 18)
    assert same_bits(gguf.quants.dequantize(rows, gguf.GGMLQuantizationType.Q4_0), reference(linear))


def test_refusals_name_the_reason():
    base = gptq_linear(128, 16, 64)
    act_order = base.g_idx[torch.randperm(128, generator=torch.Generator().manual_seed(0))]
    cases = [
        ("asymmetric", gptq_linear(128, 16, 64, zero=7)),
        ("mixes GPTQ groups", GptqLinear(base.name, base.qweight, base.qzeros, base.scales, act_order)),
        ("mixes GPTQ groups", gptq_linear(192, 16, 48)),  # 48-wide groups straddle the 32-wide blocks
        ("not whole 32-wide", gptq_linear(72, 16, 72)),
        ("not all exact in fp16", GptqLinear(base.name, base.qweight, base.qzeros, base.scales.float() + 1e-6,
                                             base.g_idx)),
    ]
    for reason, linear in cases:
        with pytest.raises(GgufExportError, match=reason):
            q4_0_rows(linear)


def tiny_target(path, hidden: int = 64, heads: int = 4, kv_heads: int = 2, mlp: int = 128) -> dict[str, np.ndarray]:
    """A one-block Llama GGUF with fp32 tensors (GGUF rows = outputs) and a small vocabulary; returns its tensors."""
    rng = np.random.default_rng(0)
    head_dim = hidden // heads
    tensors = {
        "token_embd.weight": rng.standard_normal((16, hidden), dtype=np.float32),
        "blk.0.attn_norm.weight": rng.standard_normal(hidden, dtype=np.float32),
        "blk.0.attn_q.weight": rng.standard_normal((hidden, hidden), dtype=np.float32),
        "blk.0.attn_k.weight": rng.standard_normal((kv_heads * head_dim, hidden), dtype=np.float32),
        "blk.0.ffn_down.weight": rng.standard_normal((hidden, mlp), dtype=np.float32),
    }
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_token_list([f"t{i}" for i in range(16)])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for name, data in tensors.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


def gptq_folder(folder, linears: dict[str, GptqLinear], **quant) -> None:
    folder.mkdir()
    config = {"quant_method": "gptq", "bits": 4, "sym": True, "desc_act": False, "group_size": 64,
              "checkpoint_format": "gptq"} | quant
    (folder / "config.json").write_text(json.dumps({"quantization_config": config}))
    parts = {f"{prefix}.{part}": getattr(linear, part)
             for prefix, linear in linears.items() for part in ("qweight", "qzeros", "scales", "g_idx")}
    save_file(parts, folder / "model.safetensors")


def test_export_replaces_the_linears_exactly_keeps_the_norms_and_quantizes_the_embedding(tmp_path):
    target = tmp_path / "target.gguf"
    kept = tiny_target(target)
    linears = {"model.layers.0.self_attn.q_proj": gptq_linear(64, 64, 64, seed=1),
               "model.layers.0.self_attn.k_proj": gptq_linear(64, 32, 64, seed=2),
               "model.layers.0.mlp.down_proj": gptq_linear(128, 64, 64, seed=3)}
    gptq_folder(tmp_path / "w4", linears)
    out = export_w4(tmp_path / "w4", target, tmp_path / "w4.gguf")
    read = gguf.GGUFReader(out)
    tensors = {t.name: t for t in read.tensors}
    assert read.fields["tokenizer.ggml.tokens"].contents() == [f"t{i}" for i in range(16)]
    assert read.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q4_0
    norm, embedding = tensors["blk.0.attn_norm.weight"], tensors["token_embd.weight"]
    assert norm.tensor_type == gguf.GGMLQuantizationType.F32 and np.array_equal(norm.data, kept[norm.name])
    assert embedding.tensor_type == gguf.GGMLQuantizationType.Q8_0  # as llama-quantize makes it: read per token
    weight = gguf.quants.dequantize(embedding.data, embedding.tensor_type)
    bound = np.abs(kept[embedding.name]).max(-1, keepdims=True) / 127  # a Q8_0 step, at most, per 32-wide block
    assert weight.shape == kept[embedding.name].shape and np.all(np.abs(weight - kept[embedding.name]) <= bound)
    rows = {"attn_q": rope_row_order(64, 4), "attn_k": rope_row_order(32, 2), "ffn_down": np.arange(64)}
    for (prefix, linear), (kind, order) in zip(linears.items(), rows.items()):
        written = tensors[f"blk.0.{kind}.weight"]
        assert written.tensor_type == gguf.GGMLQuantizationType.Q4_0
        assert same_bits(gguf.quants.dequantize(written.data, written.tensor_type), reference(linear)[order])
    assert not list(tmp_path.glob(".*tmp*"))


def test_export_refuses_checkpoints_q4_0_cannot_hold(tmp_path):
    target = tmp_path / "target.gguf"
    tiny_target(target)
    gptq_folder(tmp_path / "act_order", {"model.layers.0.mlp.down_proj": gptq_linear(128, 64, 64)}, desc_act=True)
    with pytest.raises(GgufExportError, match="desc_act"):
        export_w4(tmp_path / "act_order", target, tmp_path / "out.gguf")
    gptq_folder(tmp_path / "other", {"model.layers.0.mlp.down_proj": gptq_linear(256, 64, 64)})
    with pytest.raises(GgufExportError, match="not of this target"):
        export_w4(tmp_path / "other", target, tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()


@pytest.mark.slow
def test_target_gguf_holds_the_fp32_target_bit_for_bit():
    """The F32 GGUF of the bundled target is polyspec's fp32 target, q/k rows in llama.cpp's rope order."""
    from safetensors import safe_open

    from data.models import convert_bundled
    from decode.engines.llamacpp import target_gguf

    tensors = {t.name: t for t in gguf.GGUFReader(target_gguf()).tensors}
    heads = {"attn_q": 9, "attn_k": 3}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 30)
    with safe_open(str(convert_bundled("smollm2-135m-instruct") / "model.safetensors"), "pt") as hf:
        for key in hf.keys():
            name = names.get_name(key, try_suffixes=(".weight",))
            weight = hf.get_tensor(key).numpy()
            kind = name.split(".")[-2]
            if kind in heads:
                weight = weight[rope_row_order(weight.shape[0], heads[kind])]
            assert same_bits(np.asarray(tensors[name].data), weight), name
        assert len(tensors) == len(list(hf.keys()))
