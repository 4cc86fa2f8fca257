"""The door: what every stage reads from its Hydra config, read once into frozen values. Only the apps (a stage's
`main`) and the packages' settings modules see a config; everything below them takes these values."""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from omegaconf import OmegaConf

from infra.device import resolve_device
from infra.errors import ConfigError
from infra.layout import STAGE_OUTPUTS, RunLayout


def plain(node: Any) -> Any:
    """A config node as plain data (dicts, lists, scalars), interpolations resolved; anything else as it is."""
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def parse(cls: type, raw: Any, where: str, error: type[Exception] = ConfigError) -> Any:
    """A frozen dataclass `cls` from a config mapping, every value checked against its field's annotation (bool
    strictly, int, float, str, Path, Literal choices, Optional, tuples, dicts, nested dataclasses; Any as it is).
    Unknown keys are refused; absent keys take the field's default. `error` names the full key."""
    raw = plain(raw)
    if not isinstance(raw, dict):
        raise error(f"{where}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(raw) - set(hints))
    if unknown:
        raise error(f"{where}.{unknown[0]}: unknown key; known: {', '.join(hints)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    missing = [name for name, f in fields.items() if name not in raw and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise error(f"{where}.{missing[0]} is missing")
    return cls(**{key: checked(hints[key], value, f"{where}.{key}", error) for key, value in raw.items()})


def checked(hint: Any, value: Any, where: str, error: type[Exception] = ConfigError) -> Any:
    """One config value as annotation `hint` says (see `parse`), or `error` naming `where`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        problems = []
        for option in (a for a in args if a is not type(None)):
            try:
                return checked(option, value, where, error)
            except error as err:
                problems.append(str(err))
        raise error(problems[0] if len(problems) == 1 else f"{where} must be {_names(args)}, got {value!r}")
    if value is None:
        raise error(f"{where} must be set, got null")
    if origin is Literal:
        if value in args:
            return value
        raise error(f"{where} must be one of {', '.join(map(str, args))}, got {value!r}")
    if dataclasses.is_dataclass(hint):
        return parse(hint, value, where, error)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise error(f"{where} must be a list, got {value!r}")
        kinds = args[:1] * len(value) if len(args) == 2 and args[1] is Ellipsis else args
        if len(kinds) != len(value):
            raise error(f"{where} must be a list of {len(kinds)}, got {value!r}")
        return tuple(checked(k, v, f"{where}[{i}]", error) for i, (k, v) in enumerate(zip(kinds, value)))
    if origin is dict:
        if not isinstance(value, dict):
            raise error(f"{where} must be a mapping, got {value!r}")
        return {str(k): checked(args[1], v, f"{where}.{k}", error) for k, v in value.items()}
    if hint is bool and isinstance(value, bool):
        return value
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if hint is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    if hint is Path and isinstance(value, (str, Path)):
        return Path(value).expanduser()
    raise error(f"{where} must be {_names((hint,))}, got {value!r} ({type(value).__name__})")


def _names(options: tuple) -> str:
    return " or ".join("null" if o is type(None) else getattr(o, "__name__", str(o)) for o in options)


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
