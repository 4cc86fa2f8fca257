"""scripts/gpu.sh, the offline GPU check, on a CPU: its Python part end to end (--cpu-smoke: train=gpu, quantize.w4,
decode.costs, decode.bench, decode.eval on a tiny model, one results folder), and its refusals in one line before
anything runs (a damaged wheelhouse, an unknown option). The GPU run itself: BENCHMARKS.md when a GPU is at hand."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def gpu_sh(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "scripts" / "gpu.sh"), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "WANDB_MODE": "disabled"})


@pytest.mark.slow
def test_cpu_smoke_runs_every_stage_into_one_results_folder(tiny_source, chat_file, tmp_path):
    """Every stage on the tiny model, each exiting 0 (decode.eval: 0 or 3, a verdict), its outputs and log in the
    results folder. 30 min on 2 cores shared with a full suite run (the C++ kernels built in it); far less warm."""
    results = tmp_path / "results"
    done = gpu_sh("--cpu-smoke", "--results", str(results), f"model.name={tiny_source}", f"data.source={chat_file}",
                  "data.held_out_fraction=0.25", "data.max_len=256", timeout=3000)
    assert done.returncode in (0, 3), (done.stdout + done.stderr)[-4000:]
    stages = [line.split()[0] for line in (results / "stage_times.txt").read_text().splitlines()]
    assert stages == ["train.eagle", "quantize.w4", "decode.costs", "decode.bench", "decode.eval"]
    assert {p.name for p in (results / "logs").iterdir()} == {f"{s}.log" for s in stages}
    assert (results / "eagle_checkpoints" / "latest").is_file() and (results / "eagle" / "model.safetensors").is_file()
    assert "feature store: built" in done.stdout and "head: 2 steps" in done.stdout
    assert (results / "w4" / "config.json").is_file() and (results / "costs.json").is_file()
    methods = set(json.loads((results / "bench" / "bench.json").read_text())["summary"])
    # AR, prompt lookup, the W4 level (drafting for HF and in a chain), the head, the three-level chain
    assert {"ar", "hf_prompt_lookup", "lookup", "hf_assisted", "w4_lookup", "two_level", "three_level"} <= methods
    assert (results / "eval" / "report.json").is_file() and "python 3." in (results / "env.txt").read_text()


def test_a_damaged_wheelhouse_stops_the_check_in_one_line_before_any_stage(tmp_path):
    pieces = tmp_path / "pieces"
    pieces.mkdir()
    (pieces / "manifest.json").write_text(json.dumps({"pieces": [{"name": "wheelhouse.tar.part000", "bytes": 4,
                                                                  "sha256": "0" * 64}], "wheels": [],
                                                      "tar_sha256": "0" * 64}))
    (pieces / "wheelhouse.tar.part000").write_bytes(b"junk")
    results = tmp_path / "results"
    done = gpu_sh("--wheelhouse", str(pieces), "--results", str(results), "--cpu-smoke")
    assert done.returncode == 2
    assert [line for line in done.stdout.splitlines() if line.startswith("error:")] == [
        f"error: {pieces / 'wheelhouse.tar.part000'}: corrupt piece (4 bytes, sha256 differs from the manifest's); "
        "copy it again"]
    assert [line.split()[0] for line in (results / "stage_times.txt").read_text().splitlines()] == ["install"]


def test_an_unknown_option_is_refused_in_one_line(tmp_path):
    done = gpu_sh("--gpus", "2")
    assert done.returncode == 2 and done.stderr.strip() == (
        "error: unknown option --gpus (--wheelhouse DIR, --results DIR, --cpu-smoke)")
