"""The training process's device and its collectives: the config's `device` checked against torchrun's ranks, and
where a tensor must live to be all-reduced (NCCL only reduces CUDA tensors; gloo, the CPU group, host tensors)."""
from __future__ import annotations

import os
from dataclasses import dataclass
import torch
import torch.distributed as dist

from train.errors import TrainError


@dataclass(frozen=True)
class Share:
    """This process's share of a data-parallel run: rank `rank` of `world` processes does every `world`-th piece."""

    rank: int = 0
    world: int = 1


def training_device(device: torch.device) -> torch.device:
    """This process's device, the run's `device` checked. Under torchrun each rank trains on its LOCAL_RANK's GPU
    (DeepSpeed places the head there), so `cuda:N` naming another GPU is refused; a single process may name any GPU."""
    if device.type == "cuda" and "RANK" in os.environ and device.index != int(os.environ.get("LOCAL_RANK", 0)):
        raise TrainError(f"device={device}: under torchrun use device=cuda or device=auto "
                         f"(rank {os.environ['RANK']} trains on its LOCAL_RANK's GPU, "
                         f"cuda:{os.environ.get('LOCAL_RANK', 0)})")
    return device


def backend_for(device: torch.device) -> str:
    """The process group's backend: NCCL between GPUs, gloo on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def collective_device() -> torch.device:
    """Where tensors passed to all_reduce must be: this rank's GPU under NCCL, the CPU otherwise."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
