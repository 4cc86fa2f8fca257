"""The project's error classes, apart from any CLI so that every layer (the decode engine too) can raise them."""
from __future__ import annotations


class PolyspecError(Exception):
    """An error the user can fix (config, input, a missing or damaged artifact); the message is one line."""


class Interrupted(Exception):
    """A stage stopped on request after saving what it resumes from; the message says how to continue."""


class ConfigError(PolyspecError, ValueError):
    """A config value of the wrong type or range; the message is one line and names the key."""
