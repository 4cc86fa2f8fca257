"""The AVX2 product of packed linears (decode/gemm.cpp via decode.fast): right values, and each output row
independent of how many rows, threads or tiles compute it, which is what keeps a packed target's
verification consistent with its own 1-token forwards."""
from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf

from decode.build import gemm_choice
from decode.chain import DecodeError
from decode.fast import GEMMS, PackedLinear, avx2_kernel, gemm_for, pack_weight, _packed_mm


@pytest.fixture(scope="module")
def kernel():
    module, why = avx2_kernel()
    if module is None:
        pytest.skip(f"the AVX2 kernel cannot run here: {why}")
    return module


# K x N: SmolLM2's projection widths scaled down, a tile-sized one, and awkward ones (N not a multiple of 8
# or of the 3-panel tile, odd K)
SHAPES = [(64, 48), (96, 24), (33, 61), (576, 200), (16, 8)]


@pytest.mark.parametrize("k,n", SHAPES)
def test_avx2_product_matches_float64_and_rows_do_not_depend_on_batch(kernel, k, n):
    gen = torch.Generator().manual_seed(k * 1000 + n)
    weight, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    panels = pack_weight(weight, "avx2")
    x = torch.randn(13, k, generator=gen)
    full = _packed_mm(x, panels, bias)
    exact = (x.double() @ weight.double().T + bias.double()).float()
    assert full.shape == (13, n) and torch.allclose(full, exact, rtol=1e-5, atol=1e-5 * k ** 0.5)
    for m in range(1, 13):  # every tail of the 4-row tile, alone and in batches
        assert torch.equal(_packed_mm(x[:m], panels, bias), full[:m])
        assert torch.equal(_packed_mm(x[m - 1:m], panels, bias), full[m - 1:m])
    assert torch.equal(_packed_mm(x.view(1, 13, k), panels, bias), full.view(1, 13, n))  # leading dims kept


def test_avx2_product_is_bit_identical_across_thread_counts(kernel):
    gen = torch.Generator().manual_seed(3)
    weight, x = torch.randn(960, 576, generator=gen), torch.randn(8, 576, generator=gen)
    panels, threads = pack_weight(weight, "avx2"), torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(_packed_mm(x, panels, None))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_packed_linear_takes_the_configured_product_and_copies(kernel):
    linear = torch.nn.Linear(64, 40)
    for gemm, kind in (("auto", "avx2"), ("avx2", "avx2"), ("onednn", "onednn")):
        packed = PackedLinear(linear, gemm)
        assert packed.gemm == kind
        x = torch.randn(3, 64)
        with torch.inference_mode():
            assert torch.allclose(packed(x), linear(x), atol=1e-5)
            clone = copy.deepcopy(packed)
            assert torch.equal(clone(x), packed(x)) and clone.weight is not packed.weight
    assert gemm_for(torch.float32, "onednn") == "onednn" and set(GEMMS) == {"auto", "avx2", "onednn"}
    with pytest.raises(ValueError, match="gemm must be one of"):
        gemm_for(torch.float32, "mkl")


def test_decode_gemm_config_is_checked_in_one_line():
    with pytest.raises(DecodeError, match=r"decode.gemm must be one of auto, avx2, onednn, got 'mkl'"):
        gemm_choice(OmegaConf.create({"decode": {"gemm": "mkl"}}))
    assert gemm_choice(OmegaConf.create({"decode": {}})) == "auto"
