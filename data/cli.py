"""What every stage's `__main__` shares: a project error is one line on stderr and exit code 1; strictly
typed config flags; an output folder checked writable before any work."""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

_MISSING = object()


class ConfigError(ValueError):
    """A config value of the wrong type or range; the message is one line and names the key."""


def run_or_exit(stage: Callable[..., Any], *args: Any, errors: tuple[type[Exception], ...]) -> Any:
    """Run a stage; any of `errors` (and ConfigError) becomes `error: <message>` and exit 1 (no traceback,
    no Hydra noise)."""
    try:
        return stage(*args)
    except (*errors, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)


def full_key(node: Any, key: str) -> str:
    """`eval.publish.force` for key `force` of the node at eval.publish (just `key` outside OmegaConf)."""
    try:
        return node._get_full_key(key) or key
    except Exception:  # a plain dict, or a node without a parent
        return key


def flag(node: Any, key: str, default: Any = _MISSING, error: type[Exception] = ConfigError) -> bool:
    """A boolean config value, strictly: true or false, never a string such as 'false' (which is truthy).

    `default` is used when the key is absent (without one an absent key is an error too); anything but a
    real bool raises `error` with a one-line message naming the full key."""
    value = node.get(key, _MISSING) if hasattr(node, "get") else getattr(node, key, _MISSING)
    if value is _MISSING:
        if default is _MISSING:
            raise error(f"{full_key(node, key)} is missing; set it to true or false")
        return default
    if not isinstance(value, bool):
        raise error(f"{full_key(node, key)} must be true or false, got {value!r} ({type(value).__name__})")
    return value


def check_writable(path: str | os.PathLike, key: str, kind: str = "dir", error: type[Exception] = ConfigError) -> Path:
    """Refuse, before any work, an output that could not be written at the end: `path` (a folder, or a file
    for kind="file") must not be the other kind, and its nearest existing folder must accept new files
    (checked by creating and removing a temp file there, which also catches read-only mounts). Creates
    nothing that stays; returns the path."""
    path = Path(path).expanduser()
    if path.exists() and path.is_dir() != (kind == "dir"):
        raise error(f"{key}={path}: exists and is {'a folder' if path.is_dir() else 'not a folder'}")
    folder = path if kind == "dir" else path.parent
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    if not folder.is_dir():
        raise error(f"{key}={path}: {folder} is not a folder")
    try:
        with tempfile.TemporaryFile(dir=folder, prefix=".polyspec-write-test-"):
            pass
    except OSError as err:
        raise error(f"{key}={path}: cannot write there ({folder}: {err.strerror or err.__class__.__name__})") from None
    return path
