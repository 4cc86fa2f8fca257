"""The GPTQ checkpoint after GPTQModel wrote it: unpacking and dequantizing its int4 codes, re-encoding groups
the CPU kernels cannot take (a ragged last group stored as narrower groups, losslessly), and the metadata every
loader reads (the stored group size, polyspec's provenance).

Group size 128 on inputs that are not a multiple of 128 (SmolLM2's hidden 576): GPTQ quantizes with a
ragged last group (columns 512..575 form one 64-wide group with its own scale). The CPU int4 kernels
need in_features divisible by the stored group size, so the checkpoint stores every 128-wide group as
two 64-wide groups with the same scale and zero: a lossless re-encoding (checked bit for bit here),
recorded under `quantization_config.meta.polyspec` and in metrics.json."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from data.models import expert_name, expert_renaming
from quantize.errors import QuantizeError


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ packs 32/bits codes per int32 along dim 0 (qweight) or dim 1 (qzeros, after a transpose)."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    codes = (packed.unsqueeze(1) >> shifts.view(1, -1, *([1] * (packed.dim() - 1)))) & (2**bits - 1)
    return codes.reshape(packed.shape[0] * per_word, *packed.shape[1:])


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
               bits: int) -> torch.Tensor:
    """The [in, out] weight a GPTQ (v1 format) linear stands for: scale[g] * (code - (zero[g] + 1))."""
    codes = unpack_rows(qweight, bits)[: g_idx.numel()].float()
    zeros = unpack_rows(qzeros.t().contiguous(), bits).t()[:, : scales.shape[1]].float() + 1
    g = g_idx.long()
    return scales.float()[g] * (codes - zeros[g])


def storage_group_size(group_size: int, in_features: list[int]) -> int:
    """The largest group size dividing `group_size` and every quantized input width (64 for SmolLM2)."""
    return math.gcd(group_size, *in_features)


def split_groups(g_idx: torch.Tensor, group_size: int, storage: int) -> torch.Tensor:
    """Relabel columns from `group_size`-wide groups to `storage`-wide ones (ragged tails stay ragged).

    Within a group the columns are split in index order; any split is exact, since all carry one scale."""
    ratio = group_size // storage
    new = torch.empty_like(g_idx)
    for g in g_idx.unique().tolist():
        cols = (g_idx == g).nonzero().flatten()
        new[cols] = g * ratio + torch.arange(cols.numel(), dtype=g_idx.dtype) // storage
    return new


def regroup_checkpoint(folder: Path, group_size: int, bits: int) -> dict[str, Any]:
    """Re-encode `group_size`-wide groups as narrower stored groups where an input width needs it.

    Returns what was done, for the log and the checkpoint metadata. Verifies the dequantized weights are
    unchanged, bit for bit."""
    files = sorted(folder.glob("*.safetensors"))
    tensors = {f: load_file(f) for f in files}
    prefixes = {(f, k.removesuffix(".g_idx")) for f, ts in tensors.items() for k in ts if k.endswith(".g_idx")}
    widths = {p: tensors[f][f"{p}.g_idx"].numel() for f, p in prefixes}
    storage = storage_group_size(group_size, list(widths.values()))
    ragged = sorted(p for p, w in widths.items() if w % group_size)
    info = {
        "quantized_group_size": group_size, "stored_group_size": storage,
        "handling": "ragged last group" if ragged else "exact",
        "ragged_modules": len(ragged), "quantized_modules": len(widths),
        "ragged_example": (f"{ragged[0]}: in_features {widths[ragged[0]]} = {widths[ragged[0]] // group_size} x "
                           f"{group_size} + {widths[ragged[0]] % group_size}") if ragged else None,
    }
    info["description"] = (
        f"ragged last group: {len(ragged)}/{len(widths)} modules have inputs not a multiple of {group_size} "
        f"(e.g. {info['ragged_example']}); stored as {storage}-wide groups repeating each {group_size}-wide group's "
        "scale and zero (lossless, verified)" if storage != group_size
        else f"exact: every input width is a multiple of {group_size}"
    )
    if storage == group_size:
        return info
    if storage < 16:
        raise QuantizeError(f"input widths {sorted(set(widths.values()))} leave no stored group size >= 16 "
                            "the CPU kernels support")
    ratio = group_size // storage
    for f, p in prefixes:
        ts = tensors[f]
        before = dequantize(ts[f"{p}.qweight"], ts[f"{p}.qzeros"], ts[f"{p}.scales"], ts[f"{p}.g_idx"], bits)
        rows = torch.arange(math.ceil(widths[p] / storage)) // ratio
        ts[f"{p}.scales"] = ts[f"{p}.scales"][rows].contiguous()
        ts[f"{p}.qzeros"] = ts[f"{p}.qzeros"][rows].contiguous()
        ts[f"{p}.g_idx"] = split_groups(ts[f"{p}.g_idx"], group_size, storage)
        after = dequantize(ts[f"{p}.qweight"], ts[f"{p}.qzeros"], ts[f"{p}.scales"], ts[f"{p}.g_idx"], bits)
        if not torch.equal(before, after):
            raise QuantizeError(f"{p}: re-encoding {group_size}-wide groups as {storage}-wide changed the weights")
    save_tensors(folder, tensors)
    return info


# transformers' fused linears and the parts GPTQModel may quantize them as (its defuser splits Phi-3's gate_up_proj),
# in the fused output's order
FUSED = {"gate_up_proj": ("gate_proj", "up_proj"), "qkv_proj": ("q_proj", "k_proj", "v_proj")}


def class_linears(src: str) -> set[str]:
    """The names of the linear modules of the transformers class `src`'s config names (built on the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src))
    return {name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}


def fuse_split_projections(folder: Path, linears: set[str]) -> list[str]:
    """Store each fused linear of the model class (`linears`: class_linears) that the checkpoint holds in parts as
    one quantized linear, under the name the class loads: GPTQModel saves Phi-3's gate_up_proj as gate_proj and
    up_proj, which transformers' Phi3 cannot load back. Exact: the parts' output columns are concatenated, each with
    its codes, scale and zero, over the same input groups. Returns the fused modules' names."""
    files = sorted(folder.glob("*.safetensors"))
    tensors = {f: load_file(f) for f in files}
    where = {key: f for f, ts in tensors.items() for key in ts}
    fused = []
    for name in sorted(linears):
        parent, _, leaf = name.rpartition(".")
        parts = [f"{parent}.{part}" for part in FUSED.get(leaf, ())]
        if not parts or f"{name}.qweight" in where or not all(f"{p}.qweight" in where for p in parts):
            continue
        pieces = [{k.removeprefix(f"{p}."): tensors[where[k]].pop(k) for k in list(where) if k.startswith(f"{p}.")}
                  for p in parts]
        if any(not torch.equal(piece["g_idx"], pieces[0]["g_idx"]) for piece in pieces):
            raise QuantizeError(f"{name}: its parts {', '.join(parts)} were quantized over different input groups "
                                "(g_idx), so they cannot be stored as one linear")
        if any(piece["qweight"].shape[1] % (32 // 4) for piece in pieces):  # qzeros pack 8 outputs a word
            raise QuantizeError(f"{name}: a part's output width is not a multiple of 8, so its packed zeros cannot be "
                                "concatenated")
        out = tensors[where[f"{parts[0]}.qweight"]]
        for key in ("qweight", "qzeros", "scales"):
            out[f"{name}.{key}"] = torch.cat([piece[key] for piece in pieces], dim=1).contiguous()
        out[f"{name}.g_idx"] = pieces[0]["g_idx"]
        biases = [piece.get("bias") for piece in pieces]
        if any(b is not None for b in biases):
            like = next(b for b in biases if b is not None)
            out[f"{name}.bias"] = torch.cat([like.new_zeros(piece["scales"].shape[1]) if b is None else b
                                             for b, piece in zip(biases, pieces)])
        fused.append(name)
    if fused:
        save_tensors(folder, tensors)
    return fused


def store_expert_names(folder: Path, model_type: str) -> int:
    """Rename a family's routed experts to the names its original checkpoints use (data.models.STORED_EXPERT_NAMES:
    Mixtral's block_sparse_moe.experts.<e>.w1/w2/w3), which vLLM loads and load_model maps back. Returns how many
    tensors were renamed."""
    if not expert_renaming(model_type, to_stored=True):
        return 0
    tensors = {f: load_file(f) for f in sorted(folder.glob("*.safetensors"))}
    names = {key: expert_name(key, model_type, to_stored=True) for ts in tensors.values() for key in ts}
    save_tensors(folder, {f: {names[key]: value for key, value in ts.items()} for f, ts in tensors.items()})
    return sum(key != name for key, name in names.items())


def save_tensors(folder: Path, tensors: dict[Path, dict[str, torch.Tensor]]) -> None:
    """Rewrite the checkpoint's safetensors files (headers kept) and, when sharded, its index's weight map."""
    for f, ts in tensors.items():
        with safe_open(f, "pt") as handle:
            header = handle.metadata() or {"format": "pt"}
        save_file(ts, f, metadata=header)
    index_file = folder / "model.safetensors.index.json"
    if index_file.exists():
        index = json.loads(index_file.read_text())
        index["weight_map"] = {key: f.name for f, ts in sorted(tensors.items()) for key in sorted(ts)}
        index_file.write_text(json.dumps(index, indent=2) + "\n")


def static_groups(folder: Path, stored_group_size: int) -> bool:
    """Whether every stored g_idx is the static layout (column i in group i // size): what loaders that drop
    g_idx (vLLM with desc_act=false) assume. Activation order (desc_act) permutes it; act_group_aware does not."""
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, "pt") as handle:
            for key in (k for k in handle.keys() if k.endswith(".g_idx")):
                g_idx = handle.get_tensor(key)
                if not torch.equal(g_idx, torch.arange(g_idx.numel(), dtype=g_idx.dtype) // stored_group_size):
                    return False
    return True


def write_metadata(folder: Path, meta: dict[str, Any], stored_group_size: int) -> None:
    """Stored group size into the configs every loader reads; our provenance under meta.polyspec."""
    for name, key in (("config.json", "quantization_config"), ("quantize_config.json", None)):
        path = folder / name
        if not path.exists():
            continue
        config = json.loads(path.read_text())
        quant = config[key] if key else config
        quant["group_size"] = stored_group_size
        quant.setdefault("meta", {})["polyspec"] = meta
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def existing_is_valid(out: Path, meta: dict[str, Any]) -> bool:
    """A finished output of the same source weights and settings (what skip_if_valid keeps)."""
    try:
        config = json.loads((out / "config.json").read_text())
        done = config["quantization_config"]["meta"]["polyspec"]
    except (OSError, KeyError, TypeError, json.JSONDecodeError):
        return False
    keys = ("source_weights_hash", "settings")
    return (out / "metrics.json").exists() and all(done.get(k) == meta[k] for k in keys)
