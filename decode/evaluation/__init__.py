"""decode.eval's parts: the runner (decode every question with every method), the aggregation of the records, the
checks, and the gate and bundle that publish a chain. decode/eval.py is the command that strings them together."""
from __future__ import annotations

from infra.errors import PolyspecError


class EvalError(PolyspecError, RuntimeError):
    """Bad eval input (config, chain, question file); the message is one line."""
