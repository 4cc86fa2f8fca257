"""The door: what every stage reads from its Hydra config, read once into frozen values. Only the apps (a stage's
`main`) and the packages' settings modules see a config; everything below them takes these values."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from infra import schema
from infra.device import resolve_device
from infra.errors import ConfigError
from infra.layout import STAGE_OUTPUTS, RunLayout


def plain(node: Any) -> Any:
    """A config node as plain data (dicts, lists, scalars), interpolations resolved; anything else as it is."""
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def parse(cls: type, raw: Any, where: str, error: type[Exception] = ConfigError) -> Any:
    """A config section as the frozen dataclass `cls` (infra.schema.parse on its plain data)."""
    return schema.parse(cls, plain(raw), where, error)


def checked(hint: Any, value: Any, where: str, error: type[Exception] = ConfigError) -> Any:
    """One config value as annotation `hint` says (infra.schema.checked on its plain data; a count's least value from
    its annotation: infra.schema.Positive, NonNegative)."""
    return schema.checked(hint, plain(value), where, error)


@dataclass(frozen=True)
class Tracking:
    """Where and how a stage logs to W&B, and the run's whole config as plain data (what the W&B run records)."""

    mode: str
    project: str
    entity: str | None
    group: str | None
    dir: Path
    config: dict[str, Any]


def tracking_of(cfg: Any) -> Tracking:
    wcfg = cfg.get("wandb", {}) or {}
    config = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
    return Tracking(mode=str(wcfg.get("mode", "offline")), project=str(wcfg.get("project", "polyspec")),
                    entity=wcfg.get("entity"), group=wcfg.get("group"), dir=Path(str(wcfg.get("dir") or "wandb")),
                    config=config)


def layout_of(cfg: Any) -> RunLayout:
    """The layout of the run a stage's config describes (a stage's config may leave out other stages)."""
    found = {name: OmegaConf.select(cfg, key) for name, key in STAGE_OUTPUTS.items()}
    return RunLayout(Path(str(cfg.run_dir)), {name: Path(str(folder)) for name, folder in found.items()
                                              if folder is not None})


def device_of(cfg: Any) -> torch.device:
    """The run's device from its config (`device`, top level; absent = auto)."""
    return resolve_device(cfg.get("device", "auto") if hasattr(cfg, "get") else "auto")


@dataclass(frozen=True)
class RunSettings:
    """What a stage's run is beside its own section (train.eagle's, quantize.w4's): the seed, the run's folders, the
    device and W&B."""

    seed: int
    layout: RunLayout
    device: torch.device
    tracking: Tracking


def run_of(cfg: Any) -> RunSettings:
    return RunSettings(checked(int, cfg.seed, "seed"), layout_of(cfg), device_of(cfg), tracking_of(cfg))
