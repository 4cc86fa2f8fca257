"""train.eagle's error classes (every train module raises them)."""
from __future__ import annotations

from infra.errors import Interrupted, PolyspecError


class TrainError(PolyspecError, RuntimeError):
    """A bad training config or state; the message is one line, meant for the user."""


class TrainingInterrupted(Interrupted):
    """Ctrl-C (or SIGTERM) stopped training after a checkpoint was written."""
