"""benchmarks.cpu_tiles: each product kind's weight runs through the native product at the bytes per weight
the benchmark sizes its cache-resident copy with, and the benchmark prints one row per kind and row count."""
from __future__ import annotations

import pytest
import torch

from benchmarks import cpu_tiles
from decode.backends.cpu.llama import native_kernels

pytestmark = pytest.mark.skipif(native_kernels()[0] is None, reason="the native kernels do not build here")


def test_each_kind_weight_is_a_product_of_its_stated_size():
    kernels = native_kernels()[0]
    x = torch.randn(3, 576)
    for name, (make, per_weight) in cpu_tiles.kinds(kernels).items():
        weight = make(96, 576)
        y = kernels.packed_mm(x, weight)
        assert y.shape == (3, 96) and torch.isfinite(y).all(), name
        weights = 96 * 576 * per_weight  # the codes alone; scales (and bounds) on top, well under a quarter
        assert weights <= weight.nbytes < 1.25 * weights, name


def test_the_benchmark_prints_a_row_per_kind_and_row_count(capsys, virtual_clock):
    """On the test's clock (every timed span one tick), so the rates it prints are the bytes it counted over written
    times, never a busy machine's near-zero; the layout and each kind's ratio to its own first row are what is
    checked."""
    cpu_tiles.main(["--rows", "1", "2", "--repeats", "1", "--stream-mib", "4"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert len(rows) == 4 * 2
    for row in rows:
        resident, streamed, ratio = (float(v) for v in row[-4:-1])
        assert resident > 0 and streamed > 0 and ratio > 0
    assert [row[-5] for row in rows] == ["1", "2"] * 4
    assert [row[-2] for row in rows[::2]] == ["1.00"] * 4  # each kind's ratios are to its own 1-row stream
