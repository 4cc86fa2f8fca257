"""The W4A16 GPTQ intermediate model of the chain (`python -m quantize.w4`)."""

import infra.quiet  # noqa: F401,E402  (before any library logs: one line per user error)
