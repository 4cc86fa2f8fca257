"""train's door: `python -m train.eagle`'s settings, read once from the Hydra config into frozen values
(infra.settings.parse; conf/train/eagle.yaml documents every key). The checks the stage always made come first, on the
config itself, so each refusal is still its one-line TrainError; parse then refuses unknown keys and wrong types."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from omegaconf import OmegaConf

from data.settings import DataSettings, ModelSettings, data_of, model_of
from infra.schema import Positive
from infra.settings import RunSettings, parse, run_of
from train.errors import TrainError

Method = Literal["eagle", "eagle3"]  # vLLM's names: EAGLE-1/2 and EAGLE-3 heads
FeatureSource = Literal["target", "w4"]
Replies = Literal["dataset", "verifier"]
LossTokens = Literal["replies", "all"]
ZeroStage = Literal[0, 1, 2, 3]
Precision = Literal["fp32", "bf16"]
StoreDtype = Literal["float32", "bfloat16"]
StoreCompute = Literal["model", "bfloat16"]
Init = Literal["random", "target_last_layer"]
RUN_CONTROL_KEYS = ("resume", "skip_if_valid")  # how a run is driven, not what it trains


@dataclass(frozen=True)
class Regeneration:
    """train.regenerate: the feature model's own replies (train.replies=verifier)."""

    max_new_tokens: int
    batch: int


@dataclass(frozen=True)
class HeldOutEval:
    """train.eval: the held-out evaluation during and after training."""

    conversations: int
    max_prompt_len: int
    gen_tokens: int
    batch: int
    depth: int


@dataclass(frozen=True)
class MemoryFit:
    """train.fit_memory: on CUDA, the batches sized to the GPU's total memory at run time (train/fit.py): each batch
    holds as many sequences of the run's token cap as `fraction` of the memory allows at the estimated device bytes
    per token of its kind, at most `max_batch`."""

    fraction: float
    train_token_bytes: Positive
    store_token_bytes: Positive
    max_batch: Positive


@dataclass(frozen=True)
class EagleTraining:
    """The train section: the head's recipe, its data, DeepSpeed, checkpoints, output and evaluation."""

    method: Method
    aux_layers: tuple[int, ...] | None
    feature_source: FeatureSource
    replies: Replies
    regenerate: Regeneration
    loss_tokens: LossTokens
    max_conversations: int | None
    max_len: int
    epochs: int
    max_steps: int | None
    micro_batch: int
    grad_accum: int
    zero_stage: ZeroStage
    precision: Precision
    lr: float
    betas: tuple[float, ...]
    weight_decay: float
    warmup_steps: int
    min_lr_ratio: float
    grad_clip: float
    feature_weight: float
    ce_weight: float
    noise: float
    store_dtype: StoreDtype
    store_batch: int
    store_compute: StoreCompute
    draft_vocab: int | None
    unroll: int
    init: Init
    checkpoint_every: int
    keep_checkpoints: int
    resume: bool
    skip_if_valid: bool
    output: Path
    eval_every: int
    eval: HeldOutEval
    fit_memory: MemoryFit | None = None  # null: micro_batch, store_batch and regenerate.batch as written


@dataclass(frozen=True)
class TrainSettings:
    """`python -m train.eagle`: the training, its target and data, and the run (seed, folders, device, W&B)."""

    train: EagleTraining
    model: ModelSettings
    data: DataSettings
    run: RunSettings

    @property
    def token_cap(self) -> int:
        """Tokens per training conversation: the smaller of data.max_len and train.max_len."""
        return min(self.data.max_len, self.train.max_len)

    def record(self) -> dict[str, Any]:
        """The training config as a head records it (config.json: the train section, seed, data; JSON types), what
        train.skip_if_valid compares with."""
        return as_json({**asdict(self.train), "seed": self.run.seed, "data": asdict(self.data)})


def as_json(value: Any) -> Any:
    """Plain data as JSON holds it: tuples as lists, paths as strings."""
    if isinstance(value, dict):
        return {key: as_json(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [as_json(v) for v in value]
    return str(value) if isinstance(value, Path) else value


def validate(t: Any) -> None:
    """The checks of the train section the stage has always made, each with its own one-line TrainError (its
    switches, strictly true or false, are parse's)."""
    choose("method", t.method, Method)
    if t.method == "eagle3" and t.init != "random":
        raise TrainError(f"train.init={t.init!r}: an EAGLE-3 head (q/k/v over 2h inputs) starts random")
    if t.aux_layers is not None and (not OmegaConf.is_list(t.aux_layers)
                                     or not all(isinstance(i, int) for i in t.aux_layers)):
        raise TrainError(f"train.aux_layers={t.aux_layers!r}: must be a list of layer ids (or null for vLLM's default)")
    choose("feature_source", t.feature_source, FeatureSource)
    if t.zero_stage not in get_args(ZeroStage):
        raise TrainError(f"train.zero_stage={t.zero_stage}: DeepSpeed ZeRO stage must be one of 0, 1, 2, 3")
    choose("precision", t.precision, Precision)
    choose("store_dtype", t.store_dtype, StoreDtype)
    choose("store_compute", t.store_compute, StoreCompute)
    choose("replies", t.replies, Replies)
    choose("loss_tokens", t.loss_tokens, LossTokens)
    choose("init", t.init, Init)
    if t.draft_vocab is not None and (not isinstance(t.draft_vocab, int) or t.draft_vocab < 1):
        raise TrainError(f"train.draft_vocab={t.draft_vocab!r}: must be a positive integer "
                         "(or null for the full vocabulary)")
    for key in ("micro_batch", "grad_accum", "epochs", "max_len", "checkpoint_every", "store_batch", "unroll"):
        if not isinstance(t[key], int) or t[key] < 1:
            raise TrainError(f"train.{key}={t[key]!r}: must be a positive integer")
    fit = t.get("fit_memory")
    if fit is not None and not (isinstance(fit.get("fraction"), float) and 0 < fit.fraction <= 1):
        raise TrainError(f"train.fit_memory.fraction={fit.get('fraction')!r}: must be a fraction of the GPU's memory "
                         "in (0, 1]")
    for group, key in (("eval", "depth"), ("eval", "batch"), ("regenerate", "max_new_tokens"), ("regenerate", "batch")):
        if not isinstance(t[group][key], int) or t[group][key] < 1:
            raise TrainError(f"train.{group}.{key}={t[group][key]!r}: must be a positive integer")


def choose(key: str, value: Any, choices: Any) -> None:
    if value not in get_args(choices):
        raise TrainError(f"train.{key}={value!r}: must be one of {', '.join(get_args(choices))}")


def of(cfg: Any) -> TrainSettings:
    validate(cfg.train)
    return TrainSettings(parse(EagleTraining, cfg.train, "train", TrainError), model_of(cfg), data_of(cfg), run_of(cfg))
