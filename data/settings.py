"""data's door: the model and data sections every stage reads, and `python -m data.prepare`'s settings, read once
from the Hydra config into frozen values (infra.settings.parse)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infra.schema import Positive
from infra.settings import checked, parse


@dataclass(frozen=True)
class ModelSettings:
    """The chain's target (conf/model): a model spec data.models.load_model takes, and the dtype it loads in."""

    name: str
    dtype: str


@dataclass(frozen=True)
class DataSettings:
    """The ShareGPT conversations (conf/data): where they come from, tokens per conversation, the held-out share and
    the cap on the train split (None: all)."""

    source: str
    max_len: Positive
    held_out_fraction: float
    max_conversations: Positive | None = None


@dataclass(frozen=True)
class PrepareSettings:
    """`python -m data.prepare`: the target, the data, and the eval's prompt file (None: the bundled questions)."""

    model: ModelSettings
    data: DataSettings
    prompts: str | None


def model_of(cfg: Any) -> ModelSettings:
    return parse(ModelSettings, cfg.model, "model")


def data_of(cfg: Any) -> DataSettings:
    return parse(DataSettings, cfg.data, "data")


def prepare_of(cfg: Any) -> PrepareSettings:
    return PrepareSettings(model_of(cfg), data_of(cfg), checked(str | None, cfg.eval.get("prompts"), "eval.prompts"))
