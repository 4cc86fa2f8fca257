"""The config's `device` on a machine without CUDA: resolution, one-line errors before any model loads, and
`device: cpu` (the default here, through auto) leaving every stage on the CPU as before."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from infra.device import resolve_device, synchronized_clock
from infra.errors import ConfigError
from infra.settings import device_of

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def two_gpus(monkeypatch):
    """Resolution as on a machine with two GPUs (nothing is placed on them)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("LOCAL_RANK", raising=False)


def test_without_cuda_auto_and_cpu_are_the_cpu(no_cuda):
    assert resolve_device("auto") == resolve_device(None) == resolve_device(" cpu ") == torch.device("cpu")
    assert device_of(OmegaConf.create({"seed": 0})) == torch.device("cpu")  # no key: auto


@pytest.mark.parametrize("spec", ["cuda", "cuda:0"])
def test_cuda_without_cuda_is_one_line(no_cuda, spec):
    with pytest.raises(ConfigError, match=rf"^device={spec}: CUDA is not available here .*use device=cpu") as err:
        resolve_device(spec)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("spec", ["gpu", "cuda:", "cuda:x", "cuda:-1", "CPU", "mps", ""])
def test_bad_device_strings_are_refused(spec):
    with pytest.raises(ConfigError, match=r"must be auto, cpu, cuda or cuda:N"):
        resolve_device(spec)


def test_cuda_picks_this_ranks_gpu(two_gpus, monkeypatch):
    assert resolve_device("auto") == resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    monkeypatch.setenv("LOCAL_RANK", "1")  # torchrun's second rank on this node
    assert resolve_device("cuda") == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match=r"device=cuda:2: this machine has 2 CUDA device\(s\)"):
        resolve_device("cuda:2")


def test_torchrun_rank_must_train_on_its_own_gpu(two_gpus, monkeypatch):
    from infra.settings import device_of
    from train.distributed import backend_for, training_device
    from train.errors import TrainError

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert training_device(device_of(OmegaConf.create({"device": "cuda"}))) == torch.device("cuda", 1)
    with pytest.raises(TrainError, match="^device=cuda:0: under torchrun use device=cuda or device=auto"):
        training_device(device_of(OmegaConf.create({"device": "cuda:0"})))
    assert backend_for(torch.device("cuda", 1)) == "nccl" and backend_for(torch.device("cpu")) == "gloo"


def test_synchronized_clock_on_the_cpu_is_perf_counter(virtual_clock):
    """On a CPU nothing is queued: the clock is time.perf_counter read at once, whichever way the device is named."""
    assert [synchronized_clock("cpu"), synchronized_clock(), synchronized_clock(torch.device("cpu"))] == pytest.approx(
        [virtual_clock.TICK_S, 2 * virtual_clock.TICK_S, 3 * virtual_clock.TICK_S])


def test_cpu_device_keeps_the_packed_cpu_path():
    """device=cpu: decode.gemm is checked and used as before; on a GPU nothing is packed (None)."""
    from decode.settings import backend_of, decode_section

    cfg = OmegaConf.create({"device": "cpu", "decode": {"fast": True, "gemm": "onednn"}})
    assert backend_of(decode_section(cfg), device_of(cfg)).gemm == "onednn"


def test_nothing_is_packed_on_cuda(two_gpus):
    from decode.settings import backend_of, decode_section

    cfg = OmegaConf.create({"device": "cuda:1", "decode": {"fast": True, "gemm": "onednn"}})
    assert backend_of(decode_section(cfg), device_of(cfg)).gemm is None


def test_cpu_device_places_models_on_the_cpu(tiny_llama, tmp_path):
    from data.models import load_model, load_tokenizer

    tiny_llama.save_pretrained(tmp_path)
    load_tokenizer("bundled:smollm2-135m-instruct").save_pretrained(tmp_path)
    model, _ = load_model(str(tmp_path), "float32", torch.device("cpu"))
    assert model.device == torch.device("cpu")


def stage_config(tmp_path: Path, *extra: str):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=[f"run_dir={tmp_path}", f"model.name={tmp_path / 'no-model'}",
                                            f"data.source={tmp_path / 'no-data.json'}", *extra])


@pytest.mark.parametrize("door", ["train.settings:of", "quantize.settings:w4_of", "decode.settings:costs_of"])
def test_stages_check_the_device_before_loading_a_model(no_cuda, door, tmp_path):
    """The model named does not exist: the device error comes first, from the stage's settings door."""
    import importlib

    module, function = door.split(":")
    with pytest.raises(ConfigError, match=r"^device=cuda:1: CUDA is not available"):
        getattr(importlib.import_module(module), function)(stage_config(tmp_path, "device=cuda:1"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_a_stage_refuses_cuda_without_cuda_in_one_line(tmp_path):
    """Exit 2 and one `error:` line, before any model loads."""
    result = subprocess.run(
        [sys.executable, "-m", "decode.generate", "device=cuda", f"run_dir={tmp_path}",
         f"model.name={tmp_path / 'no-model'}", "prompt=hi"],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "WANDB_MODE": "disabled"})
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert (errors == [errors[0]]
            and errors[0].startswith("error: device=cuda: CUDA is not available")), result.stderr[-2000:]
