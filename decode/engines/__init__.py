"""One module per engine polyspec runs for real beside its own decoding: llama.cpp (its build, its tools and their
reports, the GGUF files it loads) and vLLM (its venv, and the script its python runs). decode.bench races them,
decode.interop checks what polyspec publishes in them; the commands chain.json gives users are
decode.publish.serving's."""
from __future__ import annotations

from infra.errors import PolyspecError


class InteropError(PolyspecError, RuntimeError):
    """Bad input to decode.interop; the message is one line, meant for the user. Here, not in the app, so that
    decode.settings can refuse interop.* with it."""
