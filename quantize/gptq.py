"""Driving GPTQModel: the calibration set (chat-templated ShareGPT training conversations) and the quantization
itself, on the CPU (the 2-core recipe) or a GPU; the checkpoint it writes is GPTQ's v1 format either way."""
from __future__ import annotations

import os
import random
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator

import torch
from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from data.sharegpt import Conversation, tokenize_conversation
from quantize.errors import QuantizeError
from quantize.settings import Quantization


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
        f"calibration: asked for {n} samples of at least {min_len} tokens, "
        f"but the training split has only {len(samples)}"
    )


def cpu_recipe(cpu_workers: int | None) -> None:
    """The 2-core recipe (docs/design.md, "Libraries the defaults rest on"): GPTQModel's CPU worker pool of
    `cpu_workers` (None: one per core). Set before it is built."""
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(cpu_workers or os.cpu_count() or 1))


@contextmanager
def transformers_as_defined(src: str) -> Iterator[None]:
    """Undo, on leaving, what GPTQModel's loader patches process-wide for `src`'s model type: it swaps transformers'
    mixture-of-experts classes for defused ones and wraps the checkpoint renaming (defuser.replace_fused_blocks).
    Every later load in this process (the stage's check of what it wrote, a target in the same test process) then
    builds the classes transformers defines, as decode does in a fresh process (data.models.experts_as_linears)."""
    import importlib

    from defuser.model_registry import MODEL_CONFIG, PATCH
    from transformers import AutoConfig

    replaced = MODEL_CONFIG.get(AutoConfig.from_pretrained(src).model_type, {}).get(PATCH.REPLACE_MODULE, [])
    renaming = "get_checkpoint_conversion_mapping"
    places = [original.rsplit(".", 1) for original, _ in replaced]
    places += [("transformers.conversion_mapping", renaming), ("transformers.modeling_utils", renaming)]
    kept = [(owner, name, owner.__dict__.get(name)) for owner, name in
            ((importlib.import_module(module), name) for module, name in places)]
    try:
        yield
    finally:
        for owner, name, value in kept:
            if value is None:
                owner.__dict__.pop(name, None)
            else:
                setattr(owner, name, value)


@contextmanager
def layer_progress(model: Any, terminal: IO[str]) -> Iterator[None]:
    """A progress bar on `terminal` of the decoder layers GPTQModel has quantized, fed by its layer callback (its own
    bars are part of what infra.logs sends to the log)."""
    layers = getattr(model.model.config.get_text_config(), "num_hidden_layers", None)
    done: set[int] = set()
    with tqdm(total=layers, desc="w4: GPTQ", unit="layer", file=terminal, dynamic_ncols=True) as bar:
        def layer_complete(layer_idx: int, submodule_finalized: bool) -> None:
            if layer_idx not in done:
                done.add(layer_idx)
                bar.update()

        model.layer_callback = layer_complete
        yield


def gptq_quantize(src: str, dst: Path, q: Quantization, calibration: list[list[int]], device: str = "cpu",
                  progress: IO[str] | None = None) -> None:
    """Run GPTQModel on `src` on `device` (its CPU path, or its GPU path on cuda[:N]) and save the checkpoint into
    `dst` (which must not exist yet); the checkpoint format is the same either way. `progress`: where the bar of
    quantized layers goes (sys.stderr by default)."""
    from gptqmodel import GPTQModel, QuantizeConfig
    from gptqmodel.looper import loop_processor

    # its per-module log, else written to ./logs (pinned 7.6.0)
    loop_processor._PROJECT_LOG_DIR = dst.parent / "gptq_logs"
    config = QuantizeConfig(
        bits=q.bits, group_size=q.group_size, sym=q.sym, desc_act=q.desc_act,
        act_group_aware=q.act_group_aware and not q.desc_act, damp_percent=q.damp_percent,
        damp_auto_increment=q.damp_auto_increment, mse=q.mse, true_sequential=q.true_sequential,
        offload_to_disk=False,  # disk offload: much slower here
    )
    with transformers_as_defined(src):
        model = GPTQModel.load(src, config, device=device, dtype=getattr(torch, q.calibration.dtype))
        with layer_progress(model, progress or sys.stderr):
            model.quantize([{"input_ids": ids, "attention_mask": [1] * len(ids)} for ids in calibration],
                           batch_size=q.calibration.batch_size)
        model.save(str(dst))
