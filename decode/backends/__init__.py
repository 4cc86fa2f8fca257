"""Backends: how a level's model runs on its device. The engine sees only a Runner and modules; the builder asks
this package what to run: the CPU backend packs linears and registers its attention (decode.backends.cpu), every
other device runs the model as transformers does."""
from __future__ import annotations

import sys
from typing import Callable

import torch
from torch import nn
from transformers import PreTrainedModel

from decode.engine.runner import RUNNER_FACTORY, HFRunner, Runner, configured_runner

NATIVE = ("auto", "on", "off")


def on_cpu(module: nn.Module) -> bool:
    return next(module.parameters()).device.type == "cpu"


def prepare(module: nn.Module, gemm: str | None, native: str = "off") -> None:
    """Make a loaded model or head fast on its device, in place (CPU: packed linears on the `gemm` product; None =
    leave it). `native` (auto, on, off): whether an fp32 Llama-family model then runs the native runner, as part of
    its configuration (decode.backends.cpu.llama.run_natively: the chain's levels and the AR reference alike)."""
    if native not in NATIVE:
        raise ValueError(f"native must be one of {', '.join(NATIVE)}, got {native!r}")
    if gemm and on_cpu(module):
        from decode.backends.cpu import pack

        pack(module, gemm)
        if native != "off" and isinstance(module, PreTrainedModel):
            from decode.backends.cpu.llama import is_quantized, run_natively

            if not is_quantized(module):
                run_natively(module, native)


def runs_natively(model: nn.Module) -> bool:
    """Whether `prepare` configured `model` to run the native runner."""
    return RUNNER_FACTORY in vars(model)


def linear_wrapper(module: nn.Module, gemm: str | None) -> Callable[[nn.Linear], nn.Module]:
    """What a linear built later for `module` (a vocabulary's LM-head rows) should run as."""
    if not gemm or not on_cpu(module):
        return lambda linear: linear
    from decode.backends.cpu.dense import packed_or_plain

    return lambda linear: packed_or_plain(linear, gemm)


def runner(model: PreTrainedModel, native: str = "off", activations: str = "int8") -> Runner:
    """The runner of a model level: the one its configuration names (`prepare`: an fp32 model may run natively);
    for a GPTQ W4 Llama-family model on the CPU, the native runner (decode.backends.cpu.llama, on int8 or fp32
    `activations`, which it checks) when `native` is "auto" (where it can run; a quantized model it cannot run is
    said once, with why) or "on" (ValueError where it cannot); otherwise the model's HF decoder with a DynamicCache."""
    if native not in NATIVE:
        raise ValueError(f"native must be one of {', '.join(NATIVE)}, got {native!r}")
    if runs_natively(model):
        return configured_runner(model)
    if model.device.type == "cuda":  # the static KV cache and CUDA graphs (decode.backends.cuda)
        from decode.backends.cuda import cuda_runner

        return cuda_runner(model)
    if native == "off" or not on_cpu(model):
        return HFRunner(model)
    from decode.backends.cpu.llama import NativeLlamaRunner, is_quantized, unsupported

    if not is_quantized(model):  # an fp32 model runs natively only as configured (`prepare`), like the reference
        return HFRunner(model)

    why = unsupported(model)
    if why is None:
        return NativeLlamaRunner(model, activations=activations)
    if native == "on":
        raise ValueError(f"native=on: the native runner cannot run {model.name_or_path}: {why}")
    print(f"decode: {model.name_or_path} runs the eager HF forward (native runner: {why})", file=sys.stderr)
    return HFRunner(model)


def lm_head(head: nn.Module, level_runner: Runner) -> nn.Module | None:
    """A faster LM head for a level run by `level_runner`, or None (keep `head`): the native int8 kernel for an
    int8 LM head (`lm_head: int8`) beside the native runner, packed once per head."""
    from decode.backends.cpu.int8 import Int8RowLinear

    if type(level_runner).__name__ != "NativeLlamaRunner" or not isinstance(head, Int8RowLinear):
        return None
    from decode.backends.cpu.llama import NativeInt8Head

    if "_native" not in vars(head):
        vars(head)["_native"] = NativeInt8Head(head)
    return vars(head)["_native"]


def gemm_choice(gemm: str, device: torch.device) -> str | None:
    """decode.gemm checked for a device: the packed product CPU models use, None off the CPU. ValueError/RuntimeError
    for an unknown name or avx2 where it cannot run."""
    if device.type != "cpu":
        return None
    from decode.backends.cpu.dense import gemm_for

    gemm_for(torch.float32, gemm)
    return gemm
