"""One tracking helper for every stage: a W&B run (offline by default) plus metrics.json on disk."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from infra.settings import Tracking


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    return value


def write_json_atomic(path: str | Path, payload: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(_jsonable(payload), indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


def replace_dir(tmp: Path, final: Path) -> None:
    """Move a finished temp folder into place; an old output is removed only once the new one is there."""
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_dir(final: str | Path) -> Iterator[Path]:
    """A temp folder beside `final` to write an artifact into: renamed into place (replacing an old one)
    when the block finishes, removed if it fails, so readers never see a half-written artifact."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        replace_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class Tracker:
    """Start with `Tracker(tracking, stage)`, log as you go, `finish(metrics_path)` at the end.

    The W&B mode comes from the config's `wandb.mode` ("offline" by default); the environment variable
    WANDB_MODE wins over the config so tests and CI can force "disabled". Online mode without a
    key would hang on a closed network, so it falls back to offline with a warning.
    """

    def __init__(self, tracking: Tracking, stage: str, job_type: str | None = None):
        import wandb

        self.stage = stage
        self.metrics: dict[str, Any] = {}
        self.inputs: list[dict[str, str]] = []
        mode = os.environ.get("WANDB_MODE") or tracking.mode
        if mode == "online" and not (os.environ.get("WANDB_API_KEY") or Path.home().joinpath(".netrc").exists()):
            print("wandb: online mode asked for but no API key found; logging offline instead")
            mode = "offline"
        tracking.dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=tracking.project,
            entity=tracking.entity,
            group=tracking.group,
            name=f"{stage}",
            job_type=job_type or stage,
            dir=str(tracking.dir),
            mode=mode,
            config=tracking.config,
            settings=wandb.Settings(init_timeout=30, silent=True, console="off"),
            reinit="finish_previous",
        )

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self.run.log(_jsonable(metrics), step=step)

    def summary(self, metrics: dict[str, Any]) -> None:
        """Final metrics: kept for metrics.json and set as the W&B run summary."""
        self.metrics.update(_jsonable(metrics))
        for k, v in self.metrics.items():
            self.run.summary[k] = v

    def log_artifact(self, path: str | Path, name: str, type: str, metadata: dict | None = None) -> None:
        import wandb

        metadata = {**(metadata or {}), **({"inputs": self.inputs} if self.inputs else {})}
        art = wandb.Artifact(name=name, type=type, metadata=_jsonable(metadata))
        path = Path(path)
        if path.is_dir():
            art.add_dir(str(path))
        else:
            art.add_file(str(path))
        self.run.log_artifact(art)

    def use_artifact(self, name: str, type: str) -> None:
        """Declare an earlier stage's artifact as an input of this run.

        Online, W&B links it (lineage graph). Offline runs cannot use artifacts at all, so the input is
        recorded in the metadata of every artifact this run logs (`inputs`) instead.
        """
        self.inputs.append({"name": name, "type": type})
        if self.run.settings.mode != "online":
            return
        try:
            self.run.use_artifact(f"{name}:latest", type=type)
        except Exception as err:  # an artifact this W&B project never received
            print(f"wandb: lineage to {name} not recorded ({err.__class__.__name__})")

    def finish(self, metrics_path: str | Path | None = None) -> None:
        if metrics_path is not None:
            write_json_atomic(metrics_path, self.metrics)
        self.run.finish()
