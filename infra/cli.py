"""What every stage's `__main__` shares: one error class for what the user can fix, one table of exit codes,
strictly typed config flags, an output folder checked writable before any work.

Exit codes of every stage (README, "Exit codes"): 0 done; 1 a crash, i.e. a bug (Python's or Hydra's
traceback; Hydra's own command-line errors exit 1 too); 2 a PolyspecError, one line on stderr (bad config or
input, a missing or damaged artifact); 3 decode.eval published nothing (no chain admissible); 4 decode.interop: a
check of the published artifacts in vLLM failed; 130 interrupted
(Ctrl-C; train.eagle writes a checkpoint first, also on SIGTERM).
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, NoReturn

from infra.errors import ConfigError, Interrupted, PolyspecError

_MISSING = object()
EXIT_USER_ERROR = 2
EXIT_NOT_PUBLISHED = 3  # decode.eval: every chain was ruled out, nothing published
EXIT_CHECK_FAILED = 4  # decode.interop: vLLM refused or disagreed with what polyspec publishes
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C


def run_main(stage: Callable[[], Any]) -> NoReturn:
    """Run a stage (its settings read from the config, then its work: `lambda: run(settings_of(cfg))`) and exit
    with the table's code: the code the stage returns if it returns an int (decode.eval: EXIT_NOT_PUBLISHED), else
    0; `error: <message>` and 2 for a PolyspecError; its message and 130 when interrupted. Anything else is a bug
    and propagates with its traceback (exit 1)."""
    try:
        result = stage()
    except PolyspecError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    except (Interrupted, KeyboardInterrupt) as stopped:
        print(str(stopped) or "interrupted", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    sys.exit(result if type(result) is int else 0)


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
