"""`python -m quantize.w4`: the W4A16 group-128 GPTQ copy of the target, the chain's intermediate verifier M2.

GPTQModel quantizes (calibrated GPTQ, 4-bit symmetric weights, activations stay 16-bit) on ShareGPT
training conversations, chat-templated like the training data. The stage then measures what the chain
needs to decide whether M2 earns its place (docs/design.md, "Theory"): held-out perplexity, greedy agreement with the
target and the acceptance length L(M1 <- M2) it implies, forward time at 1 and 8 new tokens, size.

Group size 128 on inputs that are not a multiple of 128 (SmolLM2's hidden 576): GPTQ quantizes with a
ragged last group (columns 512..575 form one 64-wide group with its own scale). The CPU int4 kernels
need in_features divisible by the stored group size, so the checkpoint stores every 128-wide group as
two 64-wide groups with the same scale and zero: a lossless re-encoding (checked bit for bit here),
recorded under `quantization_config.meta.polyspec` and in metrics.json.
"""
from __future__ import annotations

import json
import math
import os
import random
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import hydra
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from infra.layout import RunLayout
from infra.cli import PolyspecError, check_writable, flag, run_main
from infra.device import configured_device
from data.models import load_model, load_tokenizer, resolve_model_path, weights_hash
from data.sharegpt import (
    Conversation, TokenizedConversation, chat_prompt_ids, load_split,
    tokenize_conversation,
)
from infra.timing import cached_forward, median_ms
from infra.tracking import replace_dir


class QuantizeError(PolyspecError, RuntimeError):
    """Bad input to the W4 stage; the message is one line, meant for the user."""


# ---------------------------------------------------------------------------------------------- input


def source_model_path(spec: str) -> str:
    """The full-precision model folder to quantize; an already-quantized model is refused."""
    path = resolve_model_path(spec)
    config_file = Path(path) / "config.json"
    if config_file.exists():
        quant = json.loads(config_file.read_text()).get("quantization_config")
        if quant:
            method = quant.get("quant_method", "unknown method") if isinstance(quant, dict) else "unknown method"
            raise QuantizeError(f"{path}: already quantized ({method}); quantize.w4 needs a full-precision model")
    return path


def calibration_samples(
    train: list[Conversation], tokenizer: PreTrainedTokenizerBase, n: int, min_len: int, max_len: int, seed: int
) -> list[list[int]]:
    """`n` chat-templated training conversations of at least `min_len` tokens, cut at `max_len`, seeded order."""
    order = list(range(len(train)))
    random.Random(seed).shuffle(order)
    samples: list[list[int]] = []
    for i in order:
        ids = tokenize_conversation(tokenizer, train[i], max_len).input_ids
        if len(ids) >= min_len:
            samples.append(ids)
            if len(samples) == n:
                return samples
    raise QuantizeError(
        f"calibration: asked for {n} samples of at least {min_len} tokens, but the training split has only {len(samples)}"
    )


def check_output(out: Path, overwrite: bool) -> None:
    if out.exists() and not overwrite:
        raise QuantizeError(f"{out}: already exists (made from other weights or settings, or not by this stage); pass quantize.overwrite=true to replace it")


# ---------------------------------------------------------------------------------------- quantizing


def cpu_recipe(qcfg: DictConfig) -> None:
    """The 2-core recipe (docs/design.md, "Libraries the defaults rest on"): GPTQModel's CPU worker pool sized to the cores. Set before it is built."""
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(qcfg.cpu_workers or os.cpu_count() or 1))


def gptq_quantize(src: str, dst: Path, qcfg: DictConfig, calibration: list[list[int]], device: str = "cpu") -> None:
    """Run GPTQModel on `src` on `device` (its CPU path, or its GPU path on cuda[:N]) and save the checkpoint into
    `dst` (which must not exist yet); the checkpoint format is the same either way."""
    from gptqmodel import GPTQModel, QuantizeConfig
    from gptqmodel.looper import loop_processor

    loop_processor._PROJECT_LOG_DIR = dst.parent / "gptq_logs"  # its per-module log, else written to ./logs (pinned 7.6.0)
    config = QuantizeConfig(
        bits=qcfg.bits, group_size=qcfg.group_size, sym=qcfg.sym, desc_act=qcfg.desc_act,
        act_group_aware=qcfg.act_group_aware and not qcfg.desc_act, damp_percent=qcfg.damp_percent,
        damp_auto_increment=qcfg.damp_auto_increment, mse=qcfg.mse, true_sequential=qcfg.true_sequential,
        offload_to_disk=False,  # disk offload: much slower here
    )
    model = GPTQModel.load(src, config, device=device, dtype=getattr(torch, qcfg.calibration.dtype))
    model.quantize([{"input_ids": ids, "attention_mask": [1] * len(ids)} for ids in calibration], batch_size=qcfg.calibration.batch_size)
    model.save(str(dst))


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ packs 32/bits codes per int32 along dim 0 (qweight) or dim 1 (qzeros, after a transpose)."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    codes = (packed.unsqueeze(1) >> shifts.view(1, -1, *([1] * (packed.dim() - 1)))) & (2**bits - 1)
    return codes.reshape(packed.shape[0] * per_word, *packed.shape[1:])


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, bits: int) -> torch.Tensor:
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
        "ragged_example": f"{ragged[0]}: in_features {widths[ragged[0]]} = {widths[ragged[0]] // group_size} x {group_size} + {widths[ragged[0]] % group_size}" if ragged else None,
    }
    info["description"] = (
        f"ragged last group: {len(ragged)}/{len(widths)} modules have inputs not a multiple of {group_size} "
        f"(e.g. {info['ragged_example']}); stored as {storage}-wide groups repeating each {group_size}-wide group's "
        "scale and zero (lossless, verified)" if storage != group_size else f"exact: every input width is a multiple of {group_size}"
    )
    if storage == group_size:
        return info
    if storage < 16:
        raise QuantizeError(f"input widths {sorted(set(widths.values()))} leave no stored group size >= 16 the CPU kernels support")
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
    for f, ts in tensors.items():
        with safe_open(f, "pt") as handle:
            header = handle.metadata() or {"format": "pt"}
        save_file(ts, f, metadata=header)
    return info


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


# ----------------------------------------------------------------------------------------- measuring


@torch.no_grad()
def perplexity(model: PreTrainedModel, convs: list[TokenizedConversation]) -> float:
    """Perplexity on the assistant-reply tokens (what a chain level predicts when it decodes a reply)."""
    nll, count = 0.0, 0
    for conv in tqdm(convs, desc="perplexity", leave=False):
        ids = torch.tensor([conv.input_ids], device=model.device)
        mask = torch.tensor(conv.loss_mask[1:], dtype=torch.bool, device=model.device)
        logits = model(ids).logits[0, :-1].float()
        nll += F.cross_entropy(logits[mask], ids[0, 1:][mask], reduction="sum").item()
        count += int(mask.sum())
    return math.exp(nll / max(count, 1))


@torch.no_grad()
def greedy_continuation(model: PreTrainedModel, prompt: list[int], n: int, eos: int | None) -> list[int]:
    out = model.generate(
        torch.tensor([prompt], device=model.device), attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device),
        max_new_tokens=n,
        do_sample=False, eos_token_id=eos, pad_token_id=eos,
    )
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def teacher_forced_matches(model: PreTrainedModel, prompt: list[int], continuation: list[int]) -> list[bool]:
    """Whether `model`'s argmax equals the next token of `continuation`, at each of its positions."""
    logits = model(torch.tensor([prompt + continuation], device=model.device)).logits[0, len(prompt) - 1 : -1]
    return (logits.argmax(-1) == torch.tensor(continuation, device=model.device)).tolist()


def acceptance_lengths(matches: list[bool], depth: int) -> list[int]:
    """Greedy speculative rounds of a depth-`depth` draft against the target's greedy continuation.

    While the draft agrees, its own greedy tokens are the target's, so the tokens accepted per round are
    the run of teacher-forced matches (capped at depth) plus the verifier's own token. Only rounds whose
    whole window lies inside the continuation are counted."""
    lengths, pos = [], 0
    while pos + depth < len(matches):
        run = 0
        while run < depth and matches[pos + run]:
            run += 1
        lengths.append(run + 1)
        pos += run + 1
    return lengths


@torch.no_grad()
def forward_ms(models: dict[str, PreTrainedModel], context: list[int], new_tokens: list[int], repeats: int, warmup: int = 2) -> dict[str, dict[int, float]]:
    """Median ms of one forward of `n` new tokens over a KV cache of `context`, models interleaved per repeat."""
    return median_ms({name: cached_forward(model, context) for name, model in models.items()}, new_tokens, repeats, warmup)


def folder_mb(path: str | Path) -> float:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file() and f.suffix == ".safetensors") / 2**20


def evaluate(
    target: PreTrainedModel, w4: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, held_out: list[Conversation], ecfg: DictConfig
) -> dict[str, Any]:
    ppl_convs = [t for t in (tokenize_conversation(tokenizer, c, ecfg.ppl_max_len) for c in held_out[: ecfg.ppl_conversations]) if any(t.loss_mask)]
    if not ppl_convs:
        raise QuantizeError("the held-out split has no conversation with an assistant reply; raise data.held_out_fraction")
    metrics: dict[str, Any] = {
        "ppl_target": perplexity(target, ppl_convs), "ppl_w4": perplexity(w4, ppl_convs), "ppl_conversations": len(ppl_convs),
    }
    metrics["ppl_ratio"] = metrics["ppl_w4"] / metrics["ppl_target"]

    prompts = [p for p in (chat_prompt_ids(tokenizer, c.messages()[:1]) for c in held_out) if len(p) <= ecfg.max_prompt_len]
    matches: list[bool] = []
    lengths: list[int] = []
    for prompt in tqdm(prompts[: ecfg.agreement_prompts], desc="greedy agreement", leave=False):
        continuation = greedy_continuation(target, prompt, ecfg.continuation_tokens, tokenizer.eos_token_id)
        m = teacher_forced_matches(w4, prompt, continuation)
        matches += m
        lengths += acceptance_lengths(m, ecfg.draft_depth)
    metrics["greedy_agreement"] = sum(matches) / max(len(matches), 1)
    metrics["acceptance_length_m1_m2"] = statistics.mean(lengths) if lengths else float("nan")
    metrics["acceptance_rounds"] = len(lengths)
    metrics["draft_depth"] = ecfg.draft_depth

    context = [i for t in ppl_convs for i in t.input_ids][: ecfg.timing_context]
    ms = forward_ms({"target": target, "w4": w4}, context, list(ecfg.timing_tokens), ecfg.timing_repeats)
    for name, per in ms.items():
        for n, value in per.items():
            metrics[f"forward_ms_{name}_{n}tok"] = value
    metrics["timing_context"], metrics["timing_tokens"] = len(context), list(ecfg.timing_tokens)
    return metrics


# ------------------------------------------------------------------------------------------- the stage


def existing_is_valid(out: Path, meta: dict[str, Any]) -> bool:
    """A finished output of the same source weights and settings (what skip_if_valid keeps)."""
    try:
        config = json.loads((out / "config.json").read_text())
        done = config["quantization_config"]["meta"]["polyspec"]
    except (OSError, KeyError, TypeError, json.JSONDecodeError):
        return False
    keys = ("source_weights_hash", "settings")
    return (out / "metrics.json").exists() and all(done.get(k) == meta[k] for k in keys)


def remove_stale_temps(out: Path) -> None:
    """Temp dirs of runs that were killed before they could clean up (their pid is gone)."""
    for tmp in out.parent.glob(f".{out.name}.*-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(tmp, ignore_errors=True)



def report(metrics: dict[str, Any]) -> str:
    m = metrics
    rows = [("held-out perplexity", f"{m['ppl_target']:.3f}", f"{m['ppl_w4']:.3f}", f"{100 * (m['ppl_ratio'] - 1):+.1f}%")]
    for k in m["timing_tokens"]:
        target, w4 = m[f"forward_ms_target_{k}tok"], m[f"forward_ms_w4_{k}tok"]
        rows.append((f"forward ms, {k} new token{'s' if k > 1 else ''}", f"{target:.1f}", f"{w4:.1f}", f"{w4 / target:.2f}x"))
    rows.append(("size on disk, MB", f"{m['size_mb_target']:.1f}", f"{m['size_mb_w4']:.1f}", f"{m['size_mb_w4'] / m['size_mb_target']:.2f}x"))
    lines = [f"{'':26s}{'target':>10s}{'W4':>10s}{'W4/target':>12s}"] + [f"{a:26s}{b:>10s}{c:>10s}{d:>12s}" for a, b, c, d in rows]
    lines.append(f"greedy agreement {100 * m['greedy_agreement']:.1f}%  ->  L(M1 <- M2) = {m['acceptance_length_m1_m2']:.2f} tokens/round at draft depth {m['draft_depth']}")
    lines.append(f"quantization wall time {m['quantize_s']:.0f} s; group handling: {m['group_handling']}")
    return "\n".join(lines)


def run(cfg: DictConfig) -> Path:
    qcfg = cfg.quantize
    overwrite = flag(qcfg, "overwrite", error=QuantizeError)  # strictly true/false: 'false' would be truthy
    skip_if_valid = flag(qcfg, "skip_if_valid", error=QuantizeError)
    for key in ("sym", "desc_act", "act_group_aware", "true_sequential"):
        flag(qcfg, key, error=QuantizeError)
    out = RunLayout.of(cfg).output("w4")
    check_output(out, overwrite or skip_if_valid)
    check_writable(out, "quantize.output", error=QuantizeError)  # fail now, not after minutes of GPTQ
    device = configured_device(cfg)
    train, held_out = load_split(cfg.data)  # the data before any model: a bad source is refused in seconds
    src = source_model_path(cfg.model.name)
    tokenizer = load_tokenizer(src)
    target, _ = load_model(src, dtype=cfg.model.dtype, device=device)
    settings = OmegaConf.to_container(qcfg, resolve=True)
    settings = {k: v for k, v in settings.items() if k not in ("output", "overwrite", "skip_if_valid", "eval", "cpu_workers")}
    meta: dict[str, Any] = {"source_model": cfg.model.name, "source_weights_hash": weights_hash(target), "settings": settings}
    if skip_if_valid and out.exists():
        if existing_is_valid(out, meta):
            print(f"w4: {out} is a finished quantization of the same model and settings; skipping")
            return out
        check_output(out, overwrite)

    c = qcfg.calibration
    calibration = calibration_samples(train, tokenizer, c.samples, c.min_len, c.max_len, cfg.seed)
    print(f"w4: {len(calibration)} calibration samples, {sum(map(len, calibration))} tokens (mean {statistics.mean(map(len, calibration)):.0f})")

    from infra.tracking import Tracker, write_json_atomic

    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tracker = Tracker(cfg, "quantize")
    try:
        cpu_recipe(qcfg)
        start = time.perf_counter()
        gptq_quantize(src, tmp, qcfg, calibration, str(device))
        quantize_s = time.perf_counter() - start
        groups = regroup_checkpoint(tmp, qcfg.group_size, qcfg.bits)
        groups["static_g_idx"] = static_groups(tmp, groups["stored_group_size"])
        if not qcfg.desc_act and not groups["static_g_idx"]:
            raise QuantizeError("desc_act=false produced a permuted g_idx: loaders that assume static groups (vLLM) would misread it")
        meta["groups"] = groups
        print(f"w4: group size {qcfg.group_size}: {groups['description']}")
        write_metadata(tmp, meta, groups["stored_group_size"])

        w4, _ = load_model(str(tmp), dtype=cfg.model.dtype, device=device)
        metrics = evaluate(target, w4, tokenizer, held_out, qcfg.eval)
        metrics.update(
            quantize_s=quantize_s, device=str(device), size_mb_target=folder_mb(src), size_mb_w4=folder_mb(tmp), group_handling=groups["description"],
            calibration_samples=len(calibration), calibration_tokens=sum(map(len, calibration)),
            stored_group_size=groups["stored_group_size"], quantized_group_size=qcfg.group_size,
        )
        write_json_atomic(tmp / "metrics.json", metrics)
        replace_dir(tmp, out)
        print(report(metrics))
        tracker.log(metrics)
        tracker.summary(metrics)
        tracker.log_artifact(out, "w4", "model", metadata={**meta, **metrics})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        tracker.finish()
    return out


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_main(run, cfg)


if __name__ == "__main__":
    main()
