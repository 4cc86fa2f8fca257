"""Measurements of the product from outside it, not shipped in the wheel (`python -m benchmarks.<name>`, from the
repository's root); nothing in the product imports them."""

import infra.quiet  # noqa: F401,E402  (before any library logs: one line per user error)
