"""Polybasic speculative decoding: an n-level lossless chain (chain.py), its baselines, CLI and benchmark."""

import infra.quiet  # noqa: F401,E402  (before any library logs: one line per user error)
