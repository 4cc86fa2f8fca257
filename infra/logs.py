"""Where the libraries' own output goes. GPTQModel, DeepSpeed and what they load (LogBar, defuser) print banners,
per-module tables and INFO lines by the thousand, some from Python, some from their own C code; a stage runs their
calls inside `chatter_to`, which appends all of it to a file in the run's logs folder, so that the terminal keeps the
stage's own progress bars and results. `verbose: true` (conf/config.yaml) leaves everything on the terminal."""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator

STANDARD_FDS = (1, 2)


@contextmanager
def chatter_to(log: Path | None) -> Iterator[IO[str]]:
    """Inside, whatever this process writes to stdout or stderr, through Python or straight to the file descriptors,
    is appended to `log`; yields the terminal (the stderr outside) for the stage's own progress. None: nothing moves,
    and the terminal is sys.stderr."""
    if log is None:
        yield sys.stderr
        return
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in STANDARD_FDS}
    streams = sys.stdout, sys.stderr
    terminal = open(os.dup(saved[2]), "w", buffering=1, encoding="utf-8", errors="replace")
    try:
        with open(log, "a", encoding="utf-8") as sink:
            for fd in STANDARD_FDS:
                os.dup2(sink.fileno(), fd)
        sys.stdout, sys.stderr = (descriptor_stream(fd) for fd in STANDARD_FDS)
        yield terminal
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = streams
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        terminal.close()


def descriptor_stream(fd: int) -> IO[str]:
    """A text stream on descriptor `fd` that never closes it: Python's own stdout and stderr may be something else (a
    test's capture), and a library that keeps the stream writes, once the block ends, wherever `fd` points then."""
    return open(fd, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
