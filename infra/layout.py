"""Every path of a run, named once: the one object each command builds (`infra.settings.layout_of(cfg)`) to find what it
writes and what the other stages wrote.

Each stage writes where its config says: quantize.w4 to `quantize.output`, train.eagle to `train.output`
(both folders of run_dir by default). A chain level names them by the output's name, `model: w4` and
`path: eagle`, so moving an output in the config moves every reader with it: training on W4 features,
the chain builder, decode.costs and the eval's published bundle. The rest of a run's files live in run_dir.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from infra.errors import ConfigError

STAGE_OUTPUTS = {"w4": "quantize.output", "eagle": "train.output"}  # an output's name -> the config key of its folder


@dataclass(frozen=True)
class RunLayout:
    """One run's folder and the stage outputs its config sets (by name, see STAGE_OUTPUTS)."""

    run_dir: Path
    outputs: dict[str, Path] = field(default_factory=dict)

    @property
    def feature_store(self) -> Path:
        """train.eagle's cached verifier features (and regenerated replies), one folder per key."""
        return self.run_dir / "eagle_features"

    @property
    def checkpoints(self) -> Path:
        """train.eagle's resumable checkpoints."""
        return self.run_dir / "eagle_checkpoints"

    @property
    def kernels_report(self) -> Path:
        """benchmarks.w4_kernels' comparison of the int4 kernels."""
        return self.run_dir / "w4_kernels.json"

    @property
    def library_logs(self) -> Path:
        """The libraries' own output (GPTQModel's, DeepSpeed's), a file per stage (infra.logs); apart from `logs/`,
        where scripts/gpu.sh keeps each stage's terminal."""
        return self.run_dir / "library_logs"

    def output(self, name: str) -> Path:
        """The folder a stage writes: `w4` (quantize.output) or `eagle` (train.output)."""
        if name not in self.outputs:
            raise ConfigError(f"{STAGE_OUTPUTS[name]} is not set: the {name} output's folder is unknown")
        return self.outputs[name]

    def folder(self, source: str) -> Path:
        """The folder a chain level names: a stage output by its name, an absolute or existing path as it is,
        anything else a folder of run_dir."""
        if source in self.outputs:
            return self.outputs[source]
        path = Path(source).expanduser()
        return path if path.is_absolute() or path.exists() else self.run_dir / path

    def model_spec(self, spec: str) -> str:
        """A model level's `model:` as data.models.load_model takes it: the folder it names (`folder`), or the
        spec itself when it names no folder: bundled:, hf:, or a hub id (org/name, no org/ folder in run_dir)."""
        path = Path(spec).expanduser()
        hub = ("/" in spec and not path.is_absolute() and not path.exists()
               and not (self.run_dir / path.parts[0]).exists())
        return spec if spec.startswith(("bundled:", "hf:")) or hub else str(self.folder(spec))
