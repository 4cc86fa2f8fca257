"""infra.settings.parse: a config section becomes a frozen value, and a wrong key or type is one line naming it."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest
from omegaconf import OmegaConf

from infra.errors import ConfigError
from infra.schema import NonNegative, Positive
from infra.settings import parse


@dataclass(frozen=True)
class Inner:
    depth: int = 4


@dataclass(frozen=True)
class Section:
    method: Literal["eagle", "eagle3"] = "eagle"
    lr: float = 1e-3
    betas: tuple[float, ...] = (0.9,)
    steps: int | None = None
    resume: bool = False
    output: Path = Path("out")
    inner: Inner = Inner()
    triple: tuple[int, int, int] | None = None
    repeats: Positive = 1
    warmup: NonNegative = 0
    ks: tuple[Positive, ...] = (1,)
    cap: Positive | None = None


def test_a_section_parses_into_its_frozen_value_with_defaults_for_what_is_absent():
    cfg = OmegaConf.create({"s": {"method": "eagle3", "lr": 2, "betas": [0.9, 0.95], "inner": {"depth": 3}}})
    assert parse(Section, cfg.s, "s") == Section("eagle3", 2.0, (0.9, 0.95), None, False, Path("out"), Inner(3))


@pytest.mark.parametrize("raw, message", [
    ({"resume": "false"}, "s.resume must be true or false, got 'false'"),
    ({"method": "medusa"}, "s.method must be one of eagle, eagle3"),
    ({"inner": {"dept": 1}}, "s.inner: unknown key 'dept'"),
    ({"steps": "10"}, "s.steps must be int"),
    ({"triple": [1, 2]}, "s.triple must be a list of 3"),
    ({"lr": True}, "s.lr must be float"),
    ({"repeats": 0}, "s.repeats must be an integer >= 1, got 0"),
    ({"repeats": "2"}, "s.repeats must be an integer >= 1, got '2'"),
    ({"warmup": -1}, "s.warmup must be an integer >= 0, got -1"),
    ({"ks": [4, 0]}, "s.ks[1] must be an integer >= 1, got 0"),
    ({"cap": 0}, "s.cap must be an integer >= 1, got 0"),
])
def test_a_wrong_key_or_type_is_one_line_naming_it(raw, message):
    with pytest.raises(ConfigError, match="^" + message.replace("[", r"\[").replace("(", r"\(")):
        parse(Section, raw, "s")


def test_a_least_value_admits_its_bound_and_null_where_the_field_allows_it():
    value = parse(Section, {"repeats": 1, "warmup": 0, "ks": [1, 8], "cap": None}, "s")
    assert (value.repeats, value.warmup, value.ks, value.cap) == (1, 0, (1, 8), None)
