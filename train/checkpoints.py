"""Checkpoints of a training run: where it stands (Progress), saving and weights-only resuming through DeepSpeed,
and a stop flag that lets Ctrl-C / SIGTERM end the run after a checkpoint."""
from __future__ import annotations

import pickle
import re
import shutil
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from train.distributed import collective_device
from train.errors import TrainError
from train.settings import TrainSettings

CHECKPOINT_TAG = re.compile(r"step\d{7}")


@dataclass
class Progress:
    """Where training stands: saved in every checkpoint, so a resumed run continues the same curve."""

    step: int = 0
    tokens_seen: int = 0
    train_seconds: float = 0.0
    curve: list[dict[str, float]] = field(default_factory=list)  # held-out evaluations against tokens seen
    last: dict[str, float] = field(default_factory=dict)  # the last step's training metrics
    nonfinite_step: int | None = None  # the first step whose loss was NaN or infinite


def checkpoint_fingerprint(settings: TrainSettings, world: int) -> dict[str, Any]:
    """What must not change between a checkpoint and its resumption (else the data order or schedule differ)."""
    t = settings.train
    keys = ("feature_source", "max_conversations", "max_len", "epochs", "max_steps", "lr", "warmup_steps",
            "min_lr_ratio", "draft_vocab", "init", "store_dtype", "unroll")
    return {**{k: getattr(t, k) for k in keys}, "global_batch": t.micro_batch * t.grad_accum * world,
            "seed": settings.run.seed, "data_source": settings.data.source, "model": settings.model.name}


def save_checkpoint(engine: Any, ckpt_dir: Path, step: int, client_state: dict, keep: int, rank: int) -> None:
    """DeepSpeed checkpoint of step `step`; `latest` moves to it only once every rank has written."""
    tag = f"step{step:07d}"
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client_state, save_latest=False)
    dist.barrier()
    if rank == 0:
        tmp = ckpt_dir / ".latest.tmp"
        tmp.write_text(tag)
        tmp.replace(ckpt_dir / "latest")
        for old in sorted(p for p in ckpt_dir.glob("step*") if p.name != tag)[:-keep + 1 or None]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


class StopFlag:
    """First Ctrl-C/SIGTERM asks for a checkpoint-and-stop at the next step boundary; a second one kills."""

    def __init__(self):
        self.requested = False
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True
        signal.signal(signum, self._previous[signum])

    def agreed(self) -> bool:
        """Every rank stops at the same step: any rank's request stops all."""
        flag = torch.tensor([int(self.requested)], device=collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def weights_only_loading(engine: Any) -> None:
    """Make DeepSpeed read checkpoints with `torch.load(weights_only=True)`: tensors, containers and the three
    DeepSpeed classes its ZeRO optimizer state holds, never arbitrary pickled objects (no code runs on load)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    def load(path: str, map_location: Any = None) -> Any:
        with torch.serialization.safe_globals([LossScaler, ZeroStageEnum, fragment_address]):
            return torch.load(path, map_location=map_location, weights_only=True)

    engine.checkpoint_engine.load = load


def resume_progress(engine: Any, settings: TrainSettings, ckpt_dir: Path, world: int, total_steps: int,
                    rank: int) -> Progress:
    """The progress of the last checkpoint (train.resume=true and one exists), else a fresh start. Only
    this stage's own checkpoint folders (stepNNNNNNN inside the checkpoint folder) are read, weights-only."""
    if not settings.train.resume or not (ckpt_dir / "latest").is_file():
        if settings.train.resume and rank == 0:
            print(f"train.resume=true but no checkpoint in {ckpt_dir}; starting at step 0")
        return Progress()
    tag = (ckpt_dir / "latest").read_text().strip()
    if not CHECKPOINT_TAG.fullmatch(tag) or (ckpt_dir / tag).is_symlink() or not (ckpt_dir / tag).is_dir():
        raise TrainError(f"{ckpt_dir / 'latest'}: names {tag[:40]!r}, not a checkpoint of this stage "
                         f"(stepNNNNNNN inside {ckpt_dir})")
    weights_only_loading(engine)
    try:
        _, client = engine.load_checkpoint(str(ckpt_dir), tag=tag)
    except (pickle.UnpicklingError, RuntimeError, OSError, KeyError) as err:
        raise TrainError(f"{ckpt_dir / tag}: unreadable checkpoint "
                         f"({err.__class__.__name__}: {str(err).splitlines()[0][:200]})") from None
    if client is None:
        raise TrainError(f"{ckpt_dir / tag}: unreadable checkpoint")
    fingerprint = checkpoint_fingerprint(settings, world)
    if client["fingerprint"] != fingerprint:
        changed = sorted(k for k in fingerprint if client["fingerprint"].get(k) != fingerprint[k])
        raise TrainError(f"{ckpt_dir / tag}: written with a different training setup ({', '.join(changed)} changed); "
                         "resume needs the same")
    if rank == 0:
        print(f"resumed from {ckpt_dir / tag} at step {client['progress']['step']}/{total_steps}")
    return Progress(**client["progress"])
