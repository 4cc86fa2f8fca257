"""The chain's models as GGUF files for llama.cpp: the fp32 target, and the W4 level written exactly as Q4_0.

The target is the bundled Q4_1 GGUF expanded to F32 by llama-quantize: the very weights polyspec's fp32 target
holds. The W4 level is the target GGUF with its linear weights replaced: a symmetric 4-bit GPTQ linear without
activation order is a Q4_0 tensor exactly (Q4_0: blocks of 32 inputs, one fp16 scale d, w = d * (q - 8); GPTQ:
w = scale[g] * (q - 8) with each group's scale repeated over its blocks), so the codes and scales are copied, not
requantized, and llama.cpp's dequantized weights equal the checkpoint's bit for bit. Where that cannot hold
(asymmetric zeros, activation order or a group not made of whole 32-wide blocks, scales not in fp16, another
packing) the export refuses in one line. The token embedding and output layer (tied in SmolLM2: one tensor, the
output matmul reads it whole for every drafted token) are Q8_0, as in llama.cpp's own Q4_0/Q4_1 files (Q6_K needs
rows of 256; this model's are 576): kept F32 they were 113 of the draft's 175 MB (30 in Q8_0), and drafting with
it was slower than llama.cpp's plain decoding. The draft's outputs only set what is accepted, never the target's
text. Everything is written to a temp path and renamed.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import safe_open

from infra.cli import PolyspecError

Q4_0_BLOCK = 32
Q4_0_BYTES = 18  # fp16 scale + 16 bytes of two 4-bit codes each
ROPE_PERMUTED = {"attn_q": "llama.attention.head_count", "attn_k": "llama.attention.head_count_kv"}
Q8_0_TENSORS = ("token_embd.weight", "output.weight")  # quantized as llama-quantize does for a Q4_0 file
EXPORT = "linears Q4_0 exact, embeddings/output Q8_0"  # in w4_gguf's cache key: a new layout is a new file


class GgufExportError(PolyspecError, ValueError):
    """A model that cannot be written as the GGUF asked for; the message is one line, meant for the user."""


# ----------------------------------------------------------------------------------------------- target


def target_gguf(name: str = "smollm2-135m-instruct") -> Path:
    """The F32 GGUF of a bundled target (data.models.BUNDLED), written once and cached: every tensor dequantized
    by gguf's own dequantize, as transformers does when polyspec converts the same file (so the weights are the
    fp32 target's bit for bit, and no llama.cpp build is needed to make it)."""
    from data.models import BUNDLED, bundled_gguf, cache_dir

    source = bundled_gguf(name)
    out = cache_dir() / "llamacpp" / "gguf" / f"{name}-{importlib.metadata.version(BUNDLED[name][0])}-F32.gguf"
    if out.exists():
        return out
    reader = gguf.GGUFReader(source)
    tensors = {t.name: (t.data if t.tensor_type == gguf.GGMLQuantizationType.F32
                        else gguf.quants.dequantize(t.data, t.tensor_type), gguf.GGMLQuantizationType.F32)
               for t in reader.tensors}
    return _write_gguf(reader, tensors, gguf.LlamaFileType.ALL_F32, out)


def _write_gguf(reader: gguf.GGUFReader, tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]],
                file_type: gguf.LlamaFileType, out: Path) -> Path:
    """A GGUF with the reader's metadata and tensor order, the given tensors (name -> data, type), written to a
    temp path and renamed to `out`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    try:
        writer = gguf.GGUFWriter(tmp, arch)
        rewritten = (gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.FILE_TYPE)
        for item in reader.fields.values():
            if item.name.startswith("GGUF.") or item.name in rewritten:
                continue
            vtype = item.types[0]
            writer.add_key_value(item.name, item.contents(), vtype,
                                 sub_type=item.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
        writer.add_file_type(file_type)
        for tensor in reader.tensors:
            data, dtype = tensors[tensor.name]
            writer.add_tensor(tensor.name, data, raw_dtype=dtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        tmp.rename(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


# ------------------------------------------------------------------------------------------- GPTQ -> Q4_0


@dataclass(frozen=True)
class GptqLinear:
    """One GPTQ (v1 packing) linear as stored: qweight [in/8, out], qzeros [groups, out/8], scales [groups, out]."""

    name: str
    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor


def q4_0_rows(linear: GptqLinear) -> np.ndarray:
    """The linear's [out, in] weight as Q4_0 bytes, [out, in / 32 * 18]: codes and scales copied, refused in one
    line where Q4_0 cannot hold the GPTQ weight exactly."""
    from quantize.checkpoint import unpack_rows

    n_in, n_out = linear.g_idx.numel(), linear.scales.shape[1]
    if n_in % Q4_0_BLOCK:
        raise GgufExportError(f"{linear.name}: {n_in} inputs are not whole 32-wide Q4_0 blocks")
    block_groups = linear.g_idx.long().view(-1, Q4_0_BLOCK)
    if not torch.equal(block_groups, block_groups[:, :1].expand_as(block_groups)):
        raise GgufExportError(f"{linear.name}: a 32-wide block mixes GPTQ groups (activation order, or groups not made "
                              "of whole 32-wide blocks); Q4_0 has one scale per block")
    zeros = unpack_rows(linear.qzeros.t().contiguous(), 4).t()[:, :n_out] + 1
    if not torch.all(zeros == 8):
        raise GgufExportError(f"{linear.name}: asymmetric zero points; Q4_0 is symmetric (zero 8)")
    scales = linear.scales.to(torch.float16)
    if not torch.equal(scales.float(), linear.scales.float()):
        raise GgufExportError(f"{linear.name}: scales ({linear.scales.dtype}) are not all exact in fp16, "
                              "Q4_0's scale type")
    codes = unpack_rows(linear.qweight, 4)[:n_in].t().to(torch.uint8).contiguous()  # [out, in], 0..15
    blocks = codes.view(n_out, -1, Q4_0_BLOCK)
    packed = blocks[..., : Q4_0_BLOCK // 2] | (blocks[..., Q4_0_BLOCK // 2:] << 4)  # ggml: low nibbles first half
    d = scales[block_groups[:, 0]].t().contiguous()  # [out, blocks]
    rows = torch.cat([d.view(torch.uint8).view(n_out, -1, 2), packed], dim=-1)
    return rows.reshape(n_out, -1).numpy()


def rope_row_order(rows: int, heads: int) -> np.ndarray:
    """The row order convert_hf_to_gguf gives Llama's q/k weights (each head's two rotary halves interleaved,
    llama.cpp's rope layout): GGUF row i is HF row order[i]."""
    return np.arange(rows).reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(-1)


def gptq_linears(folder: Path) -> list[GptqLinear]:
    """Every quantized linear of a GPTQ checkpoint, after checking its config names what Q4_0 can hold."""
    try:
        quant = json.loads((folder / "config.json").read_text())["quantization_config"]
    except (OSError, KeyError, TypeError, json.JSONDecodeError):
        raise GgufExportError(f"{folder}: not a GPTQ checkpoint (no quantization_config in config.json)") from None
    wanted = {"quant_method": "gptq", "bits": 4, "sym": True, "desc_act": False}
    wrong = {k: quant.get(k) for k, v in wanted.items() if quant.get(k) != v}
    if quant.get("checkpoint_format", "gptq") != "gptq":
        wrong["checkpoint_format"] = quant.get("checkpoint_format")
    if wrong:
        raise GgufExportError(f"{folder}: Q4_0 holds symmetric 4-bit GPTQ without activation order exactly; "
                              f"this checkpoint has {wrong}")
    linears = []
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as handle:
            keys = set(handle.keys())
            for prefix in sorted(k.removesuffix(".qweight") for k in keys if k.endswith(".qweight")):
                parts = {p: handle.get_tensor(f"{prefix}.{p}") for p in ("qweight", "qzeros", "scales")}
                n_in = parts["qweight"].shape[0] * 8
                g_idx = (handle.get_tensor(f"{prefix}.g_idx") if f"{prefix}.g_idx" in keys  # static when absent
                         else torch.arange(n_in, dtype=torch.int32) // int(quant["group_size"]))
                linears.append(GptqLinear(prefix, g_idx=g_idx, **parts))
    if not linears:
        raise GgufExportError(f"{folder}: no quantized linear (no *.qweight) in its safetensors")
    return linears


# ---------------------------------------------------------------------------------------------- writing


def _gguf_weights(target: gguf.GGUFReader, linears: list[GptqLinear]) -> dict[str, np.ndarray]:
    """Each GPTQ linear as the Q4_0 rows of the target GGUF tensor it replaces (q/k rows in rope order)."""
    arch = str(target.fields[gguf.Keys.General.ARCHITECTURE].contents())
    if arch != "llama":
        raise GgufExportError(f"the target GGUF's architecture is {arch!r}; the W4 export maps Llama weights only")
    blocks = int(target.fields["llama.block_count"].contents())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, blocks)
    shapes = {t.name: tuple(int(n) for n in t.shape) for t in target.tensors}
    weights = {}
    for linear in linears:
        name = names.get_name(linear.name)
        n_in, n_out = linear.g_idx.numel(), linear.scales.shape[1]
        if name is None or shapes.get(f"{name}.weight") != (n_in, n_out):
            raise GgufExportError(f"{linear.name} ({n_out}x{n_in}) has no tensor of that shape in the target GGUF "
                                  f"(looked for {name}.weight): the W4 checkpoint is not of this target")
        rows = q4_0_rows(linear)
        kind = name.rsplit(".", 1)[-1]
        if kind in ROPE_PERMUTED:
            rows = rows[rope_row_order(n_out, int(target.fields[ROPE_PERMUTED[kind]].contents()))]
        weights[f"{name}.weight"] = rows
    return weights


def export_w4(gptq_folder: str | Path, target: str | Path, out: str | Path) -> Path:
    """Write the W4 level as a Q4_0 GGUF: the target GGUF's metadata, tokenizer and norms, its linear weights
    replaced by the GPTQ checkpoint's exactly (refused in one line where that cannot be exact), its embedding and
    output tensors in Q8_0 (q8_0_or_kept)."""
    reader = gguf.GGUFReader(target)
    weights = _gguf_weights(reader, gptq_linears(Path(gptq_folder)))
    tensors = {t.name: (weights[t.name], gguf.GGMLQuantizationType.Q4_0) if t.name in weights
               else q8_0_or_kept(t) for t in reader.tensors}
    return _write_gguf(reader, tensors, gguf.LlamaFileType.MOSTLY_Q4_0, Path(out))


def q8_0_or_kept(tensor: gguf.ReaderTensor) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """An F32 embedding or output tensor (Q8_0_TENSORS) whose rows are whole 32-wide blocks as Q8_0 (gguf's own
    quantizer, as the reference Q8_0 of llama.cpp); any other tensor as it is."""
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    if (tensor.name in Q8_0_TENSORS and tensor.tensor_type == gguf.GGMLQuantizationType.F32
            and tensor.data.ndim == 2 and tensor.data.shape[-1] % gguf.GGML_QUANT_SIZES[q8_0][0] == 0):
        return gguf.quants.quantize(np.asarray(tensor.data), q8_0), q8_0
    return tensor.data, tensor.tensor_type


def w4_gguf(gptq_folder: Path | None, target: Path) -> Path:
    """The W4 level's Q4_0 GGUF for a GPTQ checkpoint and target GGUF, exported once and cached by their content
    (the checkpoint's config and weights, the target file's name) and the export's layout (EXPORT)."""
    from data.models import cache_dir

    if gptq_folder is None or not (Path(gptq_folder) / "config.json").exists():
        raise GgufExportError(f"no W4 checkpoint at {gptq_folder}: run python -m quantize.w4")
    folder = Path(gptq_folder)
    digest = hashlib.sha256(f"{target.name} {EXPORT}".encode())
    for file in [folder / "config.json", *sorted(folder.glob("*.safetensors"))]:
        with file.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    out = cache_dir() / "llamacpp" / "gguf" / f"w4-{digest.hexdigest()[:16]}.Q4_0.gguf"
    return out if out.exists() else export_w4(folder, target, out)
