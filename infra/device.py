"""Where a run's models and tensors live: the config's `device` (auto | cpu | cuda | cuda:N) resolved once, before any
model loads, so that a bad value or a GPU that is not there is one line, not a traceback from deep inside a loader."""
from __future__ import annotations

import os
import re
import time
from typing import Any

import torch

from infra.errors import ConfigError

_DEVICE = re.compile(r"auto|cpu|cuda(?::(\d+))?")


def resolve_device(spec: str | None) -> torch.device:
    """`auto` (or None): cuda when CUDA is present, else cpu; `cpu`; `cuda` (this process's GPU: LOCAL_RANK's under
    torchrun, else the first); `cuda:N`. ConfigError for anything else or a GPU that is not there."""
    text = "auto" if spec is None else str(spec).strip()
    match = _DEVICE.fullmatch(text)
    if match is None:
        raise ConfigError(f"device={spec!r}: must be auto, cpu, cuda or cuda:N")
    if text == "cpu" or (text == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"device={text}: CUDA is not available here (torch {torch.__version__}, "
                          f"CUDA build: {torch.version.cuda or 'none'}); use device=cpu or device=auto")
    index = int(match.group(1)) if match.group(1) is not None else int(os.environ.get("LOCAL_RANK", 0))
    if index >= torch.cuda.device_count():
        raise ConfigError(f"device={text}: this machine has {torch.cuda.device_count()} CUDA device(s) "
                          f"(cuda:0..cuda:{torch.cuda.device_count() - 1})")
    return torch.device("cuda", index)


def checked_threads(threads: Any, key: str) -> int | None:
    """A `threads` setting: None (torch's default) or an integer >= 1; anything else a ConfigError naming `key`."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ConfigError(f"{key} must be null or an integer >= 1, got {threads!r}")
    return threads


def use_threads(threads: Any, key: str) -> int:
    """`threads` checked (checked_threads) and given to torch's intra-op pool, the one place a run sets it; returns
    the count in use."""
    if checked_threads(threads, key):
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def synchronized_clock(device: torch.device | str | None = None) -> float:
    """time.perf_counter() once the device has finished its queued work (a forward's time on CUDA is not its launch).
    None: every CUDA device this process has used (nothing to wait for on the CPU)."""
    if device is None:
        if torch.cuda.is_initialized():
            for index in range(torch.cuda.device_count()):
                torch.cuda.synchronize(index)
    elif (device.type if isinstance(device, torch.device) else torch.device(device).type) == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
