"""What every stage's `__main__` shares: a project error is one line on stderr and exit code 1."""
from __future__ import annotations

import sys
from typing import Any, Callable


def run_or_exit(stage: Callable[..., Any], *args: Any, errors: tuple[type[Exception], ...]) -> Any:
    """Run a stage; any of `errors` becomes `error: <message>` and exit 1 (no traceback, no Hydra noise)."""
    try:
        return stage(*args)
    except errors as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
