"""The engine's one error class: a chain that cannot be built or run."""
from __future__ import annotations

from infra.errors import PolyspecError


class DecodeError(PolyspecError, RuntimeError):
    """A chain that cannot be built or run; the message is one line, meant for the user."""
