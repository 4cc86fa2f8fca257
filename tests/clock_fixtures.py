"""A clock the test controls (not a test module), for the tests of code that times itself: what a timing decides
(a bandwidth, a speedup, an interval, the gate's verdict) is asserted on durations the test wrote, never on the
machine's speed. The `virtual_clock` fixture (tests/conftest.py) installs it."""
from __future__ import annotations

import threading
import time


class VirtualClock:
    """time.perf_counter and time.sleep as a test installs them (the `virtual_clock` fixture): in the test's own
    thread, time passes only when something sleeps, plus a microsecond a read (no duration is zero). Every timer the
    engine, the baselines and the planner read is time.perf_counter, so their timings, speedups, intervals and gate
    verdicts come out of the sleeps the test wrote, the same on a quiet machine and a loaded one. Any other thread
    (pytest-xdist's channel, a library's poller) keeps the real clock: a poller sleeping in a loop would otherwise
    push the test's time forward by whatever it slept, at moments the test does not choose."""

    TICK_S = 1e-6

    def __init__(self):
        self.now = 0.0
        self.owner = threading.get_ident()
        self._real_counter, self._real_sleep = time.perf_counter, time.sleep

    def perf_counter(self) -> float:
        if threading.get_ident() != self.owner:
            return self._real_counter()
        self.now += self.TICK_S
        return self.now

    def sleep(self, seconds: float) -> None:
        if threading.get_ident() != self.owner:
            return self._real_sleep(seconds)
        self.now += seconds
