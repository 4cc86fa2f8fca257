"""Publishing a chain: the gate, chain.json and the bundle (bundle.py), and the commands every engine serves it
with (serving.py)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from infra.layout import RunLayout


@dataclass(frozen=True)
class Publication:
    """Where a bundle comes from and goes: the target (`model` in `dtype`), the run and its folders, the bundle's
    folder, and the draft length its llama.cpp serve command uses."""

    model: str
    dtype: str
    run_name: str
    layout: RunLayout
    bundle: Path
    llamacpp_draft_max: int = 4
