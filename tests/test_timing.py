"""infra.timing's floors: the bytes a one-token forward streams (counted from the buffers it runs on), the read
bandwidth, and each row's T(1) against its floor; and what a forward launches."""
from __future__ import annotations

import pytest
import torch

from infra.timing import (Bandwidth, CountedStep, ReadProbe, floors, launches, level_bytes, read_bandwidth,
                          weight_bytes)


def _bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_a_tied_lm_head_is_streamed_once(tiny_llama):
    """Tied: the embedding matrix is the LM head, read whole once (the embedding lookup reads one row)."""
    assert tiny_llama.get_input_embeddings().weight is tiny_llama.get_output_embeddings().weight
    assert weight_bytes(tiny_llama) == _bytes(*tiny_llama.parameters(), *tiny_llama.buffers())


def test_an_untied_embedding_is_not_streamed(tiny_llama):
    tiny_llama.lm_head.weight = torch.nn.Parameter(tiny_llama.lm_head.weight.detach().clone())
    embedding = tiny_llama.get_input_embeddings().weight
    assert weight_bytes(tiny_llama) == _bytes(*tiny_llama.parameters(), *tiny_llama.buffers()) - _bytes(embedding)


def test_each_floor_is_its_own_bytes_over_the_bandwidth():
    times = {"big": {1: 30.0, 4: 45.0}, "small": {1: 2.0, 4: 2.5}, "uncounted": {1: 1.0, 4: 1.0}}
    steps = {"big": CountedStep(print, 10**9), "small": CountedStep(print, 5 * 10**7), "uncounted": print}
    rows = floors(times, steps, Bandwidth(2e10, "test"))
    assert set(rows) == {"big", "small"}
    assert rows["big"]["ms"] == 50.0 and rows["big"]["ratio"] == 0.6 and rows["big"]["t_k_over_t_1"] == {1: 1, 4: 1.5}
    assert rows["small"]["ms"] == 2.5 and rows["small"]["ratio"] == 0.8 and rows["small"]["bytes"] == 5 * 10**7


def _native_level(model, **compute):
    from decode.backends import Backend
    from decode.backends.cpu.llama import native_kernels
    from decode.engine.levels import LevelCompute, ModelLevel

    if native_kernels()[0] is None:
        pytest.skip(f"the native kernels do not build here: {native_kernels()[1]}")
    prepared = Backend("avx2", native_fp32="on").prepare(model)
    return ModelLevel("target", prepared, compute=LevelCompute(**compute))


@pytest.mark.cpu_kernels
def test_a_native_level_streams_its_weights_its_lm_head_and_its_cache(tiny_llama):
    """The native runner's count (the C++ decoder's own buffers) against the model's: the panels of widths that are
    multiples of 8 hold exactly the weights, so the decoder layers' and final norm's parameters, the tied LM head once,
    and the keys and values of the cached positions (2 KV heads of 16 per layer)."""
    tiny_llama.lm_head.weight = torch.nn.Parameter(tiny_llama.lm_head.weight.detach().clone())
    level, context = _native_level(tiny_llama), list(range(3, 40))
    level.forward(context, 1, "verify")
    layers = _bytes(*tiny_llama.model.layers.parameters(), tiny_llama.model.norm.weight)
    cache = 2 * 2 * 2 * len(context) * 16 * 4  # keys and values, layers, KV heads, positions, head dim, fp32
    assert level_bytes(level) == layers + _bytes(tiny_llama.lm_head.weight) + cache


@pytest.mark.cpu_kernels
def test_an_int8_lm_head_counts_its_rows_and_scales_not_the_weight_it_keeps(tiny_llama):
    from decode.backends.cpu.int8 import Int8RowLinear

    int8 = Int8RowLinear(tiny_llama.get_output_embeddings())
    level, plain = _native_level(tiny_llama, lm_head=int8), _native_level(tiny_llama)
    assert level_bytes(plain) - level_bytes(level) == _bytes(tiny_llama.lm_head.weight) - 512 * 64 - 512 * 2


def test_the_read_bandwidth_is_the_buffers_bytes_over_the_median_of_torchs_timed_sums(virtual_clock, monkeypatch):
    """Without a stream kernel, torch's sum reads the whole buffer (every float once: the sum of its ones is its
    length) once untimed, then `repeats` timed; the bandwidth is the bytes over the median of those times (durations
    the test writes: a wrong byte count, unit, statistic or timed span each give another number)."""
    seen, durations = [], iter([9.0, 4.0, 1.0, 2.0])  # the first read warms up and is not timed
    real_sum = torch.Tensor.sum

    def timed_sum(tensor: torch.Tensor) -> torch.Tensor:
        seen.append((tensor.nbytes, float(real_sum(tensor)), tensor.numel()))
        virtual_clock.sleep(next(durations))
        return real_sum(tensor)

    monkeypatch.setattr(torch.Tensor, "sum", timed_sum)
    bandwidth = read_bandwidth(gib=1 / 64, repeats=3)
    assert seen == [(2**24, 2**22, 2**22)] * 4
    assert bandwidth.bytes_per_s == pytest.approx(2**24 / 2.0, rel=1e-5)
    assert bandwidth.method.startswith("torch.sum") and bandwidth.method.endswith("median of 3")


def test_a_read_probe_reads_its_windows_in_turn_and_wraps():
    """Each call reads the next window of its buffer (never one cached by the last call), wrapping at the end."""
    seen = []
    probe = ReadProbe((lambda t: seen.append((t.data_ptr(), t.numel())) or 0.0, "recorder"), window=1024, total=4096)
    for _ in range(5):
        probe(1)
    start = probe.data.data_ptr()
    assert [((ptr - start) // 4, n) for ptr, n in seen] == [(0, 256), (256, 256), (512, 256), (768, 256), (0, 256)]
    assert probe.bandwidth({1: 2.0, 8: 4.0, 4: 1.0}).bytes_per_s == 1024 / 2.0 * 1000


def test_paired_ratios_divide_each_repeat_by_the_read_of_its_own_repeat():
    """The host's bandwidth halves three times over the repeats and the forward slows with it, always 1.2x its floor
    at that moment: paired, 1.2; paired with the wrong repeats it is not. Only counted steps and the smallest k
    count."""
    probe = ReadProbe((None, ""), window=2**20, total=2**22)
    reads = [10.0, 20.0, 40.0, 80.0]
    times = {"probe": {1: reads, 8: [1.0] * 4}, "fwd": {1: [1.2 * r / 2 for r in reads], 8: [99.0] * 4},
             "uncounted": {1: [5.0] * 4, 8: [5.0] * 4}}
    steps = {"fwd": CountedStep(print, 2**19), "uncounted": print}
    ratios = probe.paired_ratios(times, steps, "probe")
    assert set(ratios) == {"fwd"} and ratios["fwd"] == pytest.approx(1.2)
    times["fwd"][1].reverse()
    assert probe.paired_ratios(times, steps, "probe")["fwd"] != pytest.approx(1.2)


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_a_timed_forward_past_a_sliding_window_is_cropped_back_exactly(family, tmp_path):
    """The timed step crops its cache back to the context before each forward: on a model whose sliding layers
    (window 16) transformers' own cache would evict and then refuse to crop, it keeps every key and value, and
    each forward's logits are the full-sequence forward's."""
    from family_models import tiny_family_model
    from transformers import AutoModelForCausalLM

    from infra.timing import cached_forward

    model = AutoModelForCausalLM.from_pretrained(tiny_family_model(family, tmp_path)).eval()
    context = list(range(5, 50))
    step = cached_forward(model, context)
    for k in (4, 1, 8):
        logits = step(k).logits[0]
        with torch.inference_mode():
            full = model(torch.tensor([context + context[-k:]])).logits[0, -k:]
        torch.testing.assert_close(logits, full, atol=1e-4, rtol=1e-4)


def test_launches_count_each_operator_once_at_its_outermost():
    """aten::linear dispatches aten::t and aten::mm (or addmm) inside it: one launch, one product, not three."""
    x, weight, bias = torch.randn(2, 8), torch.randn(4, 8), torch.randn(4)
    counted = launches(lambda k: torch.nn.functional.linear(x, weight, bias).relu().sum(), "cpu")
    assert counted == {"kernels": 3, "products": 1}
    assert launches(lambda k: (x @ weight.T, x @ weight.T), "cpu")["products"] == 2
