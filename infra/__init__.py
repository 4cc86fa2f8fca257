"""The project's infrastructure, shared by every stage: errors and exit codes, devices, run layout, timing, tracking.

`infra.quiet` runs first: library chatter is silenced before any library loads, so a user error is one line."""

import infra.quiet  # noqa: F401,E402
