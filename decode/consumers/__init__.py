"""The engines that serve what polyspec publishes, run for real: their environments, their runners and the files
they load (GGUF export); the commands chain.json gives users are decode.publish.serving's."""
from __future__ import annotations

from infra.errors import PolyspecError


class InteropError(PolyspecError, RuntimeError):
    """Bad input to decode.interop; the message is one line, meant for the user. Here, not in the app, so that
    decode.settings can refuse interop.* with it."""
