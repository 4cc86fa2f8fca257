"""Batches sized to the GPU (`train.fit_memory`, conf/train/gpu.yaml): a recipe written once fills an 80 GiB H100 and
a 141 GiB H200 alike, instead of a micro batch tuned for one card that leaves the other mostly idle or runs out of
memory. Each batch holds as many sequences of the run's token cap as `fraction` of the device's total memory
(torch.cuda.get_device_properties at run time) allows at the yaml's estimated bytes per token; under torchrun every
rank takes the smallest rank's sizes, since the micro batches of a step are cut the same way on every rank."""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from train.distributed import collective_device
from train.settings import EagleTraining, MemoryFit


def batch_for(total_bytes: int, fit: MemoryFit, token_bytes: int, tokens: int) -> int:
    """Sequences of `tokens` tokens a batch may hold within `fit.fraction` of `total_bytes`, 1 to fit.max_batch."""
    return max(1, min(fit.max_batch, int(fit.fraction * total_bytes) // (token_bytes * tokens)))


def fit_to_memory(t: EagleTraining, device: torch.device, tokens: int, rank: int) -> EagleTraining:
    """The training section with micro_batch, store_batch and regenerate.batch sized to this device's memory (CUDA
    with train.fit_memory set), the same on every rank; as written elsewhere, said in one line."""
    fit = t.fit_memory
    if fit is None:
        return t
    if device.type != "cuda":
        if rank == 0:
            print(f"train.fit_memory: not on CUDA ({device}); micro_batch {t.micro_batch}, store_batch "
                  f"{t.store_batch}, regenerate.batch {t.regenerate.batch} as written")
        return t
    props = torch.cuda.get_device_properties(device)
    generated = tokens + t.regenerate.max_new_tokens  # a prompt of up to the cap and its reply
    sizes = torch.tensor([batch_for(props.total_memory, fit, fit.train_token_bytes, tokens),
                          batch_for(props.total_memory, fit, fit.store_token_bytes, tokens),
                          batch_for(props.total_memory, fit, fit.store_token_bytes, generated)],
                         device=collective_device())
    if dist.is_initialized():
        dist.all_reduce(sizes, op=dist.ReduceOp.MIN)
    micro, store, regenerate = sizes.tolist()
    if rank == 0:
        print(f"train.fit_memory: {props.name}, {props.total_memory / 2**30:.0f} GiB x {fit.fraction:g}: micro_batch "
              f"{micro}, store_batch {store}, regenerate.batch {regenerate} (sequences of <= {tokens} tokens)")
    return replace(t, micro_batch=micro, store_batch=store, regenerate=replace(t.regenerate, batch=regenerate))
