"""The CUDA backend: decoding a small model on a GPU is bound by kernel launches (HF's eager forward issues hundreds per
token), not by the weights it streams, so a model level runs on a preallocated KV cache whose forwards of the widths a
chain feeds are captured once as CUDA graphs and replayed (runner.StaticRunner)."""
from __future__ import annotations

import functools
import sys
from typing import Callable

from transformers import PreTrainedModel

from decode.backends.cuda.runner import MAX_LENGTH, WIDTHS, StaticRunner, unsupported
from decode.engine.runner import HFRunner, Runner

__all__ = ["MAX_LENGTH", "WIDTHS", "StaticRunner", "cuda_runners", "unsupported"]


def cuda_runners(model: PreTrainedModel, widths: tuple[int, ...] | None = None, max_length: int | None = None,
                 runner: Callable[..., Runner] = StaticRunner) -> Callable[[], Runner]:
    """New static graph runners of `model` (`runner`, StaticRunner or a subclass: graphs for `widths`, a cache of
    `max_length` positions), or HFRunners where it cannot run them (said once, with why)."""
    why = unsupported(model)
    if why is None:
        return functools.partial(runner, model, widths, max_length)
    name = model.name_or_path or type(model).__name__
    print(f"decode: {name} runs the eager HF forward (static runner: {why})", file=sys.stderr)
    return functools.partial(HFRunner, model)
