"""quantize's error class (every quantize module raises it)."""
from __future__ import annotations

from infra.errors import PolyspecError


class QuantizeError(PolyspecError, RuntimeError):
    """Bad input to the W4 stage; the message is one line, meant for the user."""
