"""decode.eval's parts: the decoding (every question with every method: decoding.py), the aggregation of the
records and the checks; decode.publish publishes the chain they pick. decode/eval.py is the command that strings
them together."""
from __future__ import annotations

from infra.errors import PolyspecError


class EvalError(PolyspecError, RuntimeError):
    """Bad eval input (config, chain, question file); the message is one line."""
