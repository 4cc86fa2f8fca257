"""`python -m quantize.w4`: the W4A16 group-128 GPTQ copy of the target, the chain's intermediate verifier M2.

GPTQModel quantizes (calibrated GPTQ, 4-bit symmetric weights, activations stay 16-bit) on ShareGPT
training conversations, chat-templated like the training data (quantize/gptq.py); the checkpoint is re-encoded
where the CPU kernels need it (quantize/checkpoint.py); the stage then measures what the chain needs
(quantize/evaluation.py) and writes the model, its metrics.json and W&B run, all or nothing.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig
from transformers import AutoConfig, PreTrainedModel

from data.models import (IncompleteCheckpointError, first_names, load_model, load_tokenizer, nonfinite_tensors,
                         resolve_model_path, weights_hash)
from data.sharegpt import load_split
from infra.cli import check_writable, run_main
from infra.layout import RunLayout
from infra.logs import chatter_to
from infra.tracking import replace_dir
from quantize.checkpoint import (class_linears, existing_is_valid, fuse_split_projections, regroup_checkpoint,
                                 static_groups, storage_group_size, store_expert_names, write_metadata)
from quantize.errors import QuantizeError
from quantize.evaluation import evaluate_w4, folder_mb, report
from quantize.gptq import calibration_samples, cpu_recipe, gptq_quantize
from quantize.settings import Quantization, W4Settings, w4_of


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


def check_group_size(path: str, group_size: int) -> None:
    """quantize.group_size against the linear input widths in the model's config.json, before any model loads: the
    CPU kernels store groups of at least 16 columns, each dividing every width (a ragged last group is re-encoded as
    narrower ones), which a group size or a model may not allow."""
    config = AutoConfig.from_pretrained(path).get_text_config()
    heads = config.num_attention_heads
    widths = sorted({config.hidden_size, config.intermediate_size,
                     heads * (getattr(config, "head_dim", None) or config.hidden_size // heads)})
    if math.gcd(*widths) < 16:
        raise QuantizeError(f"{path}: linear input widths {widths} are not all multiples of 16, which the CPU int4 "
                            "kernels need: not supported; set model.name to another model")
    if storage_group_size(group_size, widths) < 16:
        raise QuantizeError(f"quantize.group_size={group_size} shares fewer than 16 columns with the model's linear "
                            f"input widths {widths}; set it to a multiple of {math.gcd(*widths, 128)}")


def check_output(out: Path, overwrite: bool) -> None:
    if out.exists() and not overwrite:
        raise QuantizeError(f"{out}: already exists (made from other weights or settings, or not by this stage); "
                            "pass quantize.overwrite=true to replace it")


def remove_stale_temps(out: Path) -> None:
    """Temp dirs of runs that were killed before they could clean up (their pid is gone)."""
    for tmp in out.parent.glob(f".{out.name}.*-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(tmp, ignore_errors=True)


def validated_output(q: Quantization, layout: RunLayout) -> Path:
    """The output folder, checked before anything loads: not there unless it may be replaced or kept, writable."""
    out = layout.output("w4")
    check_output(out, q.overwrite or q.skip_if_valid)
    check_writable(out, "quantize.output", error=QuantizeError)  # fail now, not after minutes of GPTQ
    return out


def provenance(q: Quantization, source_model: str, target: PreTrainedModel) -> dict[str, Any]:
    """What a finished output must match to be kept: the source weights and the settings that shape the model."""
    ignored = ("output", "overwrite", "skip_if_valid", "eval", "cpu_workers")
    settings = {k: v for k, v in asdict(q).items() if k not in ignored}
    return {"source_model": source_model, "source_weights_hash": weights_hash(target), "settings": settings}


def check_finite(folder: Path) -> None:
    """Refuse a checkpoint holding a NaN or an infinity (a scale of a degenerate Hessian), naming the tensor."""
    from safetensors.torch import load_file

    bad = [name for file in sorted(folder.glob("*.safetensors")) for name in nonfinite_tensors(load_file(file))]
    if bad:
        raise QuantizeError(f"GPTQ computed non-finite values in {first_names(bad)}"
                            ", so nothing is written; raise quantize.damp_percent or quantize.calibration.samples")


def chatter_log(settings: W4Settings) -> Path | None:
    """Where GPTQModel's own output goes (infra.logs): a file of the run's library_logs, or the terminal (None) with
    `verbose`."""
    return None if settings.verbose else settings.run.layout.library_logs / "quantize.w4.log"


def quantize_into(tmp: Path, src: str, calibration: list[list[int]], meta: dict[str, Any],
                  settings: W4Settings) -> float:
    """GPTQ into `tmp`, its groups re-encoded for the CPU kernels and its metadata written; seconds GPTQ took."""
    q = settings.quantize
    cpu_recipe(q.cpu_workers)
    start = time.perf_counter()
    with chatter_to(chatter_log(settings)) as terminal:
        gptq_quantize(src, tmp, q, calibration, str(settings.run.device), terminal)
    quantize_s = time.perf_counter() - start
    check_finite(tmp)
    fused = fuse_split_projections(tmp, class_linears(src))
    if fused:
        print(f"w4: {len(fused)} fused linears stored whole, as the model class loads them (e.g. {fused[0]})")
    renamed = store_expert_names(tmp, AutoConfig.from_pretrained(src).model_type)
    if renamed:
        print(f"w4: {renamed} expert tensors stored under the family's original names, as vLLM loads them")
    groups = regroup_checkpoint(tmp, q.group_size, q.bits)
    groups["static_g_idx"] = static_groups(tmp, groups["stored_group_size"])
    if not q.desc_act and not groups["static_g_idx"]:
        raise QuantizeError("desc_act=false produced a permuted g_idx: loaders that assume static groups (vLLM) "
                            "would misread it")
    meta["groups"] = groups
    print(f"w4: group size {q.group_size}: {groups['description']}")
    write_metadata(tmp, meta, groups["stored_group_size"])
    return quantize_s


def measured(tmp: Path, src: str, target: PreTrainedModel, held_out: list, settings: W4Settings) -> dict[str, Any]:
    """The W4 model in `tmp` evaluated against the target, with the numbers of how it was made."""
    q, device = settings.quantize, settings.run.device
    try:
        with chatter_to(chatter_log(settings)):
            w4, _ = load_model(str(tmp), dtype=settings.model.dtype, device=device)
    except IncompleteCheckpointError as err:  # nothing measured or written from a model missing weights
        raise QuantizeError(f"the W4 model GPTQModel saved does not load back whole, so nothing is written: "
                            f"{err.detail}; quantize.w4 does not support this model's layout") from None
    metrics = evaluate_w4(target, w4, load_tokenizer(src), held_out, q.eval)
    groups = json.loads((tmp / "config.json").read_text())["quantization_config"]["meta"]["polyspec"]["groups"]
    return metrics | {"device": str(device), "size_mb_target": folder_mb(src),
                      "size_mb_w4": folder_mb(tmp), "group_handling": groups["description"],
                      "stored_group_size": groups["stored_group_size"], "quantized_group_size": q.group_size}


def run(settings: W4Settings) -> Path:
    from infra.tracking import Tracker, write_json_atomic

    q, device = settings.quantize, settings.run.device
    out = validated_output(q, settings.run.layout)
    train, held_out = load_split(settings.data)  # the data before any model: a bad source is refused in seconds
    src = source_model_path(settings.model.name)
    check_group_size(src, q.group_size)
    tokenizer = load_tokenizer(src)
    target, _ = load_model(src, dtype=settings.model.dtype, device=device)
    meta = provenance(q, settings.model.name, target)
    if q.skip_if_valid and out.exists():
        if existing_is_valid(out, meta):
            print(f"w4: {out} is a finished quantization of the same model and settings; skipping")
            return out
        check_output(out, q.overwrite)
    c = q.calibration
    calibration = calibration_samples(train, tokenizer, c.samples, c.min_len, c.max_len, settings.run.seed)
    tokens = sum(map(len, calibration))
    print(f"w4: {len(calibration)} calibration samples, {tokens} tokens (mean {tokens / len(calibration):.0f})")
    if log := chatter_log(settings):
        print(f"w4: GPTQModel's own output goes to {log} (verbose=true: to the terminal)")
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tracker = Tracker(settings.run.tracking, "quantize")
    try:
        quantize_s = quantize_into(tmp, src, calibration, meta, settings)
        metrics = measured(tmp, src, target, held_out, settings) | {
            "quantize_s": quantize_s, "calibration_samples": len(calibration), "calibration_tokens": tokens}
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
    run_main(lambda: run(w4_of(cfg)))


if __name__ == "__main__":
    main()
