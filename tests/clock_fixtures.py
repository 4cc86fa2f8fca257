"""A clock the test controls (not a test module), for the tests of code that times itself: what a timing decides
(a bandwidth, a speedup, an interval, the gate's verdict) is asserted on durations the test wrote, never on the
machine's speed. The `virtual_clock` fixture (tests/conftest.py) installs it."""
from __future__ import annotations


class VirtualClock:
    """time.perf_counter and time.sleep as a test installs them (the `virtual_clock` fixture): time passes only when
    something sleeps, plus a microsecond a read (no duration is zero). Every timer the engine, the baselines and the
    planner read is time.perf_counter, so their timings, speedups, intervals and gate verdicts come out of the sleeps
    the test wrote, the same on a quiet machine and a loaded one."""

    TICK_S = 1e-6

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += self.TICK_S
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
