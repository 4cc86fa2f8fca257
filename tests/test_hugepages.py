"""Memory in transparent huge pages (infra/hugepages.py): copies equal to what was placed, in mappings the kernel
was advised to back with huge pages (smaps' VmFlags `hg`), alive as long as any tensor cut from them; every packer's
final output and the read probe's buffer placed there, and nothing placed where the system offers none."""
from __future__ import annotations

import gc

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from decode.backends.cpu import pack
from decode.backends.cpu.llama import int4_weight, int8_weight, native_kernels
from infra import hugepages
from infra.timing import ReadProbe

needs_huge_pages = pytest.mark.skipif(not hugepages.available(), reason="this system offers no transparent huge pages")


def advised(tensor: torch.Tensor) -> bool:
    """Whether the mapping holding the tensor's first byte is advised for huge pages (MADV_HUGEPAGE: VmFlags hg)."""
    address, inside = tensor.data_ptr(), False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return "hg" in line.split()[1:]
    raise AssertionError(f"no mapping holds address {address:#x}")


@needs_huge_pages
def test_a_placed_tensor_is_an_aligned_copy_in_advised_memory():
    for tensor in (torch.randn(3, 1000), torch.arange(7), torch.randint(0, 255, (5, 9), dtype=torch.uint8)):
        placed = hugepages.in_huge_pages(tensor)
        assert torch.equal(placed, tensor) and placed.dtype == tensor.dtype and placed.is_contiguous()
        assert placed.data_ptr() != tensor.data_ptr() and placed.data_ptr() % hugepages.ALIGN == 0
        assert advised(placed) and not advised(torch.randn(3, 1000))


@needs_huge_pages
def test_placed_tensors_outlive_each_other_across_chunks(monkeypatch):
    """Many tensors over several small chunks, half of them freed: the rest keep their values (a chunk is unmapped
    only with its last tensor), and a tensor larger than a chunk gets a chunk of its own size."""
    monkeypatch.setattr(hugepages, "CHUNK", hugepages.HUGE_PAGE)
    monkeypatch.setattr(hugepages, "_chunk", None)
    placed = [hugepages.in_huge_pages(torch.full((100_000,), i, dtype=torch.int32)) for i in range(12)]
    big = hugepages.in_huge_pages(torch.ones(3 * hugepages.HUGE_PAGE // 4))
    del placed[::2]
    gc.collect()
    assert [int(t[0]) for t in placed] == list(range(1, 12, 2)) and all(bool((t == t[0]).all()) for t in placed)
    assert bool((big == 1).all()) and advised(big)


def test_nothing_is_placed_where_the_system_offers_no_huge_pages(monkeypatch):
    monkeypatch.setattr(hugepages, "available", lambda: False)
    tensor = torch.randn(4, 4)
    assert hugepages.in_huge_pages(tensor) is tensor


@needs_huge_pages
def test_a_baseline_on_small_pages_is_placed_nowhere_and_only_inside():
    tensor = torch.randn(4, 4)
    with hugepages.small_pages():
        assert hugepages.in_huge_pages(tensor) is tensor and not advised(hugepages.empty((1 << 20,)))
    assert advised(hugepages.in_huge_pages(tensor))


@needs_huge_pages
@pytest.mark.skipif(native_kernels()[0] is None, reason="the native kernels do not build here")
def test_every_packers_final_output_lies_in_huge_pages():
    """The panels a packed model runs on (stacked siblings and lone linears), and the native kernels' int4 and
    int8 weights (words and scales)."""
    torch.manual_seed(3)
    model, kernels = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                  tie_word_embeddings=False)).eval(), native_kernels()[0]
    assert pack(model, "avx2") > 0
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert advised(attention.q_proj.sibling[0].run.packed.data) and advised(mlp.down_proj.packed.data)
    assert advised(model.lm_head.packed.data)
    placed = model.lm_head.packed.data.data_ptr()
    assert pack(model, "avx2") == 0 and model.lm_head.packed.data.data_ptr() == placed  # packed again: not copied
    codes, scales = torch.randint(0, 16, (32, 64), dtype=torch.int32), torch.rand(32, 1) + 0.1
    for weight in (int4_weight(kernels, (codes, scales, None), 64, "int8"), int8_weight(kernels, [mlp.down_proj])):
        assert advised(weight.words) and advised(weight.scales)


@needs_huge_pages
def test_the_read_probe_reads_the_pages_the_weights_lie_in():
    """A floor is the bytes over the read of a buffer in the same kind of pages as the weights (4 KiB pages read
    slower than 2 MiB ones), and says so."""
    probe = ReadProbe((None, ""), window=2**21, total=2**23)
    assert advised(probe.data) and bool((probe.data == 1).all()) and "2 MiB pages" in probe.name
