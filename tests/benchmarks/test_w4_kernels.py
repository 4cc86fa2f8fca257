"""benchmarks.w4_kernels on a tiny W4 model: every model it could run gets a time for each of quantize.eval's
timing_tokens and its kernel kind, and the report it writes is what it returns."""
from __future__ import annotations

import json

from w4_fixtures import stage_config

from benchmarks.w4_kernels import run
from quantize.settings import kernels_of, w4_of
from quantize.w4 import run as quantize


def test_the_comparison_has_a_row_per_runnable_model_with_each_timing_and_its_kernel(tiny_source, chat_file,
                                                                                      tmp_path):
    cfg = stage_config(tiny_source, chat_file, tmp_path / "run", **{"eval.timing_context": 32})
    quantize(w4_of(cfg))
    settings = kernels_of(cfg)
    result = run(settings)
    assert {"target fp32", "target bf16"} <= set(result)
    assert any(name.startswith("W4") for name in result), sorted(result)
    for name, row in result.items():
        assert set(row) == {"ms_1tok", "ms_8tok", "kernel"}, (name, row)
        assert isinstance(row["kernel"], str) and row["kernel"], (name, row)
    assert result["target fp32"]["kernel"] == "dense"
    assert json.loads(settings.layout.kernels_report.read_text()) == result
