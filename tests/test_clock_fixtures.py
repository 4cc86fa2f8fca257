"""The test's clock (clock_fixtures.VirtualClock): time passes in the test's thread only by the sleeps written there,
whatever another thread of the process does meanwhile."""
from __future__ import annotations

import threading
import time

import pytest


def test_the_tests_time_is_what_it_slept_while_another_thread_sleeps_for_real(virtual_clock):
    """A second thread sleeping in a loop (as pytest-xdist's channel and library pollers do) sleeps for real and
    moves nothing: under xdist such a thread once pushed a timed read 5,107 s long."""
    done = threading.Event()

    def poller() -> None:
        for _ in range(5):
            time.sleep(0.01)
        done.set()

    start = time.perf_counter()
    thread = threading.Thread(target=poller)
    thread.start()
    done.wait()
    time.sleep(2.0)
    elapsed = time.perf_counter() - start
    thread.join()
    assert elapsed == pytest.approx(2.0 + virtual_clock.TICK_S, abs=1e-9)
