"""quantize.w4 through GPTQModel's GPU path writes the CPU path's checkpoint format. Marked `gpu`; skipped without
CUDA."""
from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf
from w4_fixtures import stage_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU (torch.cuda.is_available() is False)")]


def test_quantize_w4_on_cuda_writes_the_cpu_checkpoint_format(tiny_source, chat_file, tmp_path):
    """GPTQModel's GPU path: the same tensors (names, shapes, dtypes) and quantization config as the CPU path."""
    from safetensors import safe_open

    from quantize.settings import w4_of
    from quantize.w4 import run

    outputs = {}
    for device in ("cpu", "cuda"):
        cfg = stage_config(tiny_source, chat_file, tmp_path / device)
        OmegaConf.update(cfg, "device", device)
        outputs[device] = run(w4_of(cfg))
    layouts = {}
    for device, out in outputs.items():
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            layouts[device] = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    assert layouts["cuda"] == layouts["cpu"]
    quant = {d: json.loads((out / "config.json").read_text())["quantization_config"] for d, out in outputs.items()}
    assert ({k: v for k, v in quant["cuda"].items() if k != "meta"}
            == {k: v for k, v in quant["cpu"].items() if k != "meta"})
    assert json.loads((outputs["cuda"] / "metrics.json").read_text())["device"].startswith("cuda")
