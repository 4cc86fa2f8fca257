"""Shared ground for every stage: model sources, ShareGPT data, prompt sets, tracking."""

import data.quiet  # noqa: F401,E402  (before any library logs: one line per user error)
