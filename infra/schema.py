"""Plain data checked against a frozen dataclass's annotations: the one schema check behind every settings door and
the chain spec. No config library here; the doors hand it plain data."""
from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

from infra.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class AtLeast:
    """An int field's least value, as its annotation's metadata (`Positive`, `NonNegative`): checked by `parse` with
    the field's full key, so a count of 0 fails at the door in one line, not later inside a decode or a timing loop."""

    value: int


Positive = Annotated[int, AtLeast(1)]
NonNegative = Annotated[int, AtLeast(0)]


def parse(cls: type, raw: Any, where: str, error: type[Exception] = ConfigError, least: int | None = None) -> Any:
    """A frozen dataclass `cls` from a mapping of plain data, every value checked against its field's annotation
    (bool strictly, int (at least `least` where given, and its AtLeast), float, str, Path, Literal choices, Optional,
    tuples, dicts, nested dataclasses; Any as it is). Unknown keys are refused; absent keys take the field's default.
    `error` names the full key."""
    if dataclasses.is_dataclass(raw) and isinstance(raw, cls):
        return raw
    if not isinstance(raw, dict):
        raise error(f"{where}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls, include_extras=True)
    unknown = sorted(set(raw) - set(hints))
    if unknown:
        raise error(f"{where}: unknown key {unknown[0]!r}; known: {', '.join(hints)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    missing = [name for name, f in fields.items() if name not in raw and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise error(f"{where}.{missing[0]} is missing")
    return cls(**{key: checked(hints[key], value, _key(where, key), error, least) for key, value in raw.items()})


def checked(hint: Any, value: Any, where: str, error: type[Exception] = ConfigError, least: int | None = None) -> Any:
    """One value as annotation `hint` says (see `parse`), or `error` naming `where`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin is Annotated:
        bound = next((m.value for m in hint.__metadata__ if isinstance(m, AtLeast)), None)
        return _at_least(args[0], bound, value, where, error, least)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        problems = []
        for option in (a for a in args if a is not type(None)):
            try:
                return checked(option, value, where, error, least)
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
        return parse(hint, value, where, error, least)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise error(f"{where} must be a list, got {value!r}")
        kinds = args[:1] * len(value) if len(args) == 2 and args[1] is Ellipsis else args
        if len(kinds) != len(value):
            raise error(f"{where} must be a list of {len(kinds)}, got {value!r}")
        return tuple(checked(k, v, f"{where}[{i}]", error, least) for i, (k, v) in enumerate(zip(kinds, value)))
    if origin is dict:
        if not isinstance(value, dict):
            raise error(f"{where} must be a mapping, got {value!r}")
        return {str(k): checked(args[1], v, _key(where, k), error, least) for k, v in value.items()}
    if hint is bool and isinstance(value, bool):
        return value
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        if least is not None and value < least:
            raise error(f"{where} must be >= {least}, got {value}")
        return value
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if hint is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    if hint is Path and isinstance(value, (str, Path)):
        return Path(value).expanduser()
    if hint is bool:  # as infra.cli.flag says it: a string such as 'false' would be truthy
        raise error(f"{where} must be true or false, got {value!r} ({type(value).__name__})")
    raise error(f"{where} must be {_names((hint,))}, got {value!r} ({type(value).__name__})")


def _at_least(hint: Any, bound: int | None, value: Any, where: str, error: type[Exception],
              least: int | None) -> Any:
    """`value` as `hint` (an int) at least `bound`, or one message for both a wrong kind and a small value."""
    if bound is None:
        return checked(hint, value, where, error, least)
    try:
        result = checked(hint, value, where, error, least)
    except error:
        result = None
    if result is None or result < bound:
        raise error(f"{where} must be an integer >= {bound}, got {value!r}")
    return result


def _key(where: str, key: Any) -> str:
    """`eval.plan` + `mu` -> `eval.plan.mu`; a place named in words (`chain level 2`) + `mu` -> `chain level 2: mu`."""
    return f"{where}: {key}" if " " in where else f"{where}.{key}"


def _names(options: tuple) -> str:
    return " or ".join("null" if o is type(None) else getattr(o, "__name__", str(o)) for o in options)
