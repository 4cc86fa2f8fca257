"""scripts/wheelhouse.py, offline: the wheels packed into pieces of at most the limit and a manifest, joined back
byte for byte, and a corrupt, missing or foreign piece refused in one line before any wheel is extracted; the pins it
collects leave torch (and what torch requires) to the GPU host. The downloads themselves need the network and are
not tested here (scripts/wheelhouse.sh)."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "wheelhouse.py"


def wheelhouse(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


@pytest.fixture
def planted(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """Three planted wheels (random bytes, 2.5 MiB in all) packed into 1 MiB pieces under tmp_path/pieces."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    files = {"a-1.0-py3-none-any.whl": os.urandom(1_500_000), "b-2.0-cp312-cp312-manylinux2014_x86_64.whl":
             os.urandom(1_100_000), "c-0.1-py3-none-any.whl": b"tiny"}
    for name, data in files.items():
        (wheels / name).write_bytes(data)
    (wheels / "notes.txt").write_text("not a wheel: left out")
    done = wheelhouse("split", str(wheels), str(tmp_path / "pieces"), "--piece-mib", "1", "--python", "3.12")
    assert done.returncode == 0, done.stderr
    assert "3 wheels" in done.stdout and "3 pieces of <= 1 MiB" in done.stdout
    return tmp_path / "pieces", files


def test_pieces_are_within_the_limit_and_join_back_byte_for_byte(planted, tmp_path):
    pieces, files = planted
    manifest = json.loads((pieces / "manifest.json").read_text())
    assert manifest["python"] == "3.12" and [w["name"] for w in manifest["wheels"]] == sorted(files)
    on_disk = sorted(p.name for p in pieces.iterdir())
    assert on_disk == ["manifest.json", "wheelhouse.tar.part000", "wheelhouse.tar.part001", "wheelhouse.tar.part002"]
    for piece in manifest["pieces"]:
        data = (pieces / piece["name"]).read_bytes()
        assert len(data) == piece["bytes"] <= 1 << 20 and hashlib.sha256(data).hexdigest() == piece["sha256"]
    done = wheelhouse("join", str(pieces), str(tmp_path / "out"))
    assert done.returncode == 0 and "3 wheels verified" in done.stdout, done.stderr
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == files
    again = wheelhouse("split", str(tmp_path / "wheels"), str(tmp_path / "again"), "--piece-mib", "1")
    assert again.returncode == 0  # the same wheels give the same pieces
    assert [(pieces / p["name"]).read_bytes() == (tmp_path / "again" / p["name"]).read_bytes()
            for p in manifest["pieces"]] == [True] * 3


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing", "manifest"])
def test_a_damaged_wheelhouse_is_refused_in_one_line_and_nothing_is_extracted(planted, tmp_path, damage):
    pieces, _ = planted
    piece = pieces / "wheelhouse.tar.part001"
    data = piece.read_bytes()
    if damage == "flip":
        piece.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    elif damage == "truncate":
        piece.write_bytes(data[:-10])
    elif damage == "missing":
        piece.unlink()
    else:
        (pieces / "manifest.json").write_text("{not json")
    done = wheelhouse("join", str(pieces), str(tmp_path / "out"))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    expected = {"flip": "part001: corrupt piece", "truncate": "part001: corrupt piece", "missing": "part001: missing",
                "manifest": "manifest.json: unreadable"}[damage]
    assert done.stderr.startswith("error: ") and expected in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()


def test_nothing_to_pack_is_refused_in_one_line(tmp_path):
    done = wheelhouse("split", str(tmp_path), str(tmp_path / "pieces"))
    assert done.returncode == 2 and done.stderr.strip() == f"error: {tmp_path}: no .whl files to pack"


def test_the_pins_leave_torch_and_its_cuda_binaries_to_the_gpu_host():
    """collect: the project's dependencies as installed here (scripts/setup.sh's pins), for the host's Python; torch's
    pure-Python requirements travel (a host's fsspec may miss datasets' range)."""
    from importlib.metadata import version

    done = wheelhouse("collect", "--python", "3.12")
    assert done.returncode == 0, done.stderr
    pins = done.stdout.split()
    names = {pin.split("==")[0] for pin in pins}
    assert f"transformers=={version('transformers')}" in pins and {"deepspeed", "hydra-core", "pytest"} <= names
    assert not names & {"torch", "polyspec", "triton"} and {"filelock", "fsspec", "jinja2"} <= names
    assert not any(name.startswith("nvidia-") for name in names)
