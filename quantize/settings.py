"""quantize's door: `python -m quantize.w4`'s and `python -m benchmarks.w4_kernels`' settings, read once from the
Hydra config into frozen values (infra.settings.parse; conf/quantize/w4.yaml documents every key)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data.settings import DataSettings, ModelSettings, data_of, model_of
from infra.cli import flag
from infra.layout import RunLayout
from infra.schema import NonNegative, Positive
from infra.settings import RunSettings, layout_of, parse, run_of
from quantize.errors import QuantizeError


@dataclass(frozen=True)
class Calibration:
    """quantize.calibration: the chat-templated training conversations GPTQ calibrates on."""

    samples: Positive
    min_len: NonNegative
    max_len: Positive
    batch_size: Positive
    dtype: str


@dataclass(frozen=True)
class W4Evaluation:
    """quantize.eval: what the stage measures of the W4 model against the target (the timing keys:
    benchmarks.w4_kernels too)."""

    ppl_conversations: Positive
    ppl_max_len: Positive
    agreement_prompts: Positive
    max_prompt_len: Positive
    continuation_tokens: Positive
    draft_depth: Positive
    timing_context: Positive
    timing_repeats: Positive
    timing_tokens: tuple[Positive, ...]


@dataclass(frozen=True)
class Quantization:
    """The quantize section: GPTQ's settings, the output's handling, calibration and evaluation."""

    output: Path
    overwrite: bool
    skip_if_valid: bool
    bits: int
    group_size: int
    sym: bool
    desc_act: bool
    act_group_aware: bool
    damp_percent: float
    damp_auto_increment: float
    true_sequential: bool
    mse: float
    cpu_workers: Positive | None
    calibration: Calibration
    eval: W4Evaluation


@dataclass(frozen=True)
class W4Settings:
    """`python -m quantize.w4`: the quantization, the model it quantizes, the data it calibrates on, the run, and
    whether GPTQModel's own output stays on the terminal (`verbose`) or goes to the run's library_logs."""

    quantize: Quantization
    model: ModelSettings
    data: DataSettings
    run: RunSettings
    verbose: bool


@dataclass(frozen=True)
class KernelsSettings:
    """`python -m benchmarks.w4_kernels`: the target, the held-out data for the timing context, the timing itself, and
    the run (where the W4 model is and the report goes)."""

    model: ModelSettings
    data: DataSettings
    timing: W4Evaluation
    layout: RunLayout


def w4_of(cfg: Any) -> W4Settings:
    """Every value checked by parse, each refusal a one-line QuantizeError (a flag strictly true or false: the
    string 'false' would be truthy); `verbose` is the run's top-level key, false where a config leaves it out."""
    return W4Settings(parse(Quantization, cfg.quantize, "quantize", QuantizeError), model_of(cfg), data_of(cfg),
                      run_of(cfg), flag(cfg, "verbose", False, QuantizeError))


def kernels_of(cfg: Any) -> KernelsSettings:
    return KernelsSettings(model_of(cfg), data_of(cfg), parse(W4Evaluation, cfg.quantize.eval, "quantize.eval",
                                                              QuantizeError), layout_of(cfg))
