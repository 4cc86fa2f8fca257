"""Training stages: `python -m train.eagle` trains the EAGLE draft head."""

import infra.quiet  # noqa: F401,E402  (before any library logs: one line per user error)
