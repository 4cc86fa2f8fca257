"""Data for every stage: model sources, ShareGPT conversations, prompt sets, draft vocabularies."""

import infra.quiet  # noqa: F401,E402  (before any library logs: one line per user error)
