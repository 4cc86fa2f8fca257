"""The AVX2 kernels of decode.fast (decode/backends/cpu/kernels.cpp): the packed linears' product and attention give the
right values, and each output row is independent of how many rows, threads or tiles compute it, so a packed
target's verification of k tokens (a chain, or a tree) gives exactly the logits of k one-token forwards."""
from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from decode.settings import decode_section, gemm_choice
from decode.engine.errors import DecodeError
from decode.backends.cpu.dense import GEMMS, PackedLinear, gemm_for, pack_weight, packed_mm
from decode.backends.cpu.attention import KERNEL_ATTENTION
from decode.backends.cpu.kernels import kernel_ops, build_folder

pytestmark = pytest.mark.cpu_kernels


@pytest.fixture(scope="module")
def kernel():
    module, why = kernel_ops()
    if module is None:
        pytest.skip(f"the AVX2 kernel cannot run here: {why}")
    return module


# K x N: SmolLM2's projection widths scaled down, a tile-sized one, and awkward ones (N not a multiple of 8
# or of the 3-panel and 2-panel tiles, odd K)
SHAPES = [(64, 48), (96, 24), (33, 61), (576, 200), (16, 8)]


@pytest.mark.parametrize("k,n", SHAPES)
def test_avx2_product_matches_float64_and_rows_do_not_depend_on_batch(kernel, k, n):
    gen = torch.Generator().manual_seed(k * 1000 + n)
    weight, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    panels = pack_weight(weight, "avx2")
    x = torch.randn(13, k, generator=gen)
    full = packed_mm(x, panels, bias)
    exact = (x.double() @ weight.double().T + bias.double()).float()
    assert full.shape == (13, n) and torch.allclose(full, exact, rtol=1e-5, atol=1e-5 * k ** 0.5)
    for m in range(1, 13):  # every tail of the 4-row tile, the 5-6 row tile, alone and in batches
        assert torch.equal(packed_mm(x[:m], panels, bias), full[:m])
        assert torch.equal(packed_mm(x[m - 1:m], panels, bias), full[m - 1:m])
    assert torch.equal(packed_mm(x.view(1, 13, k), panels, bias), full.view(1, 13, n))  # leading dims kept


def test_avx2_product_is_bit_identical_across_thread_counts(kernel):
    gen = torch.Generator().manual_seed(3)
    weight, x = torch.randn(960, 576, generator=gen), torch.randn(8, 576, generator=gen)
    panels, threads = pack_weight(weight, "avx2"), torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(packed_mm(x, panels, None))
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
    with pytest.raises(DecodeError, match=r"^decode.gemm must be one of auto, avx2, onednn, got 'mkl'"):
        gemm_choice("mkl", torch.device("cpu"))
    assert decode_section(OmegaConf.create({"decode": {}})).gemm == gemm_choice("auto", torch.device("cpu")) == "auto"


def sdpa_reference(q, k, v, mask):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    return out.transpose(1, 2).float()


@pytest.mark.parametrize("rows", [1, 3, 8, 17])
def test_attend_matches_sdpa_for_every_mask_and_rows_depend_on_neither_batch_nor_threads(kernel, rows):
    gen = torch.Generator().manual_seed(rows)
    batch, heads, kv_heads, dim, keys = 2, 6, 2, 32, 45
    q = torch.randn(batch, heads, rows, dim, generator=gen)
    k, v = (torch.randn(batch, kv_heads, keys, dim, generator=gen),
            torch.randn(batch, kv_heads, keys, dim, generator=gen))
    allowed = torch.ones(rows, keys, dtype=torch.bool).tril(keys - rows)
    allowed[-1, 3] = False  # a hole, as a tree mask makes
    additive = torch.zeros(rows, keys).masked_fill(~allowed, torch.finfo(torch.float32).min)
    causal = torch.ones(rows, keys, dtype=torch.bool).tril(keys - rows)  # the cache's keys, then the new rows in order
    for mask, seen, is_causal in ((allowed, allowed, False), (additive, allowed, False), (None, causal, rows > 1)):
        reference = sdpa_reference(q, k, v, seen[None, None])
        out = kernel.attend(q, k, v, None if mask is None else mask[None, None], dim ** -0.5, is_causal)
        assert out.shape == (batch, rows, heads, dim) and torch.allclose(out, reference, atol=2e-6)
    for t in range(rows):  # each row alone: the same bits
        alone = kernel.attend(q[:, :, t:t + 1], k, v, additive[None, None, t:t + 1], dim ** -0.5, False)
        assert torch.equal(alone, kernel.attend(q, k, v, additive[None, None], dim ** -0.5, False)[:, t:t + 1])
        seen = keys - rows + t + 1  # a causal row: the bits of a one-token forward on the keys it sees
        prefix = kernel.attend(q[:, :, t:t + 1], k[:, :, :seen], v[:, :, :seen], None, dim ** -0.5, False)
        assert torch.equal(prefix, kernel.attend(q, k, v, None, dim ** -0.5, rows > 1)[:, t:t + 1])
    nothing = torch.zeros(1, 1, rows, keys, dtype=torch.bool)
    assert torch.equal(kernel.attend(q, k, v, nothing, 1.0, False), torch.zeros(batch, rows, heads, dim))
    threads = torch.get_num_threads()  # the threads share the rows among them: any count, the same bits
    try:
        by_threads = []
        for count in (1, 2, 3, 5):
            torch.set_num_threads(count)
            by_threads.append(kernel.attend(q, k, v, additive[None, None], dim ** -0.5, False))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(out, by_threads[0]) for out in by_threads[1:])


def test_attend_softcaps_scores_before_the_mask_and_keeps_rows_exact(kernel):
    """Gemma 2's scores, cap * tanh(s / cap), then the mask: the kernel's equal float64's and differ from uncapped
    ones (capping ignored is caught); a row alone gives the same bits."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, 5, 16, generator=gen) * 4, torch.randn(1, 2, 23, 16, generator=gen) * 4,
               torch.randn(1, 2, 23, 16, generator=gen))
    allowed = torch.ones(5, 23, dtype=torch.bool).tril(18)
    cap, scale = 5.0, 16 ** -0.5
    scores = torch.einsum("bhtd,bhld->bhtl", q.double(), k.repeat_interleave(2, 1).double()) * scale
    capped = (cap * torch.tanh(scores / cap)).masked_fill(~allowed, float("-inf"))
    reference = (torch.softmax(capped, -1) @ v.repeat_interleave(2, 1).double()).transpose(1, 2).float()
    out = torch.ops.polyspec.attend(q, k, v, allowed[None, None], scale, False, None, cap)
    assert torch.allclose(out, reference, atol=2e-6)
    uncapped = torch.ops.polyspec.attend(q, k, v, allowed[None, None], scale, False, None)
    assert (uncapped - reference).abs().max() > 1e-2
    alone = torch.ops.polyspec.attend(q[:, :, 2:3], k, v, allowed[None, None, 2:3], scale, False, None, cap)
    assert torch.equal(alone, out[:, 2:3])


def test_a_packed_softcapped_model_attends_on_the_kernel_row_exact(kernel):
    """Gemma 2 (eager attention for its softcapping) packed on the AVX2 product attends on the kernel: its logits are
    the eager model's (and not those of the model with softcapping ignored), a k-token forward gives the bits of k
    one-token forwards, and unpack gives eager attention back."""
    import transformers
    from transformers import DynamicCache

    from decode.backends.cpu import unpack
    from decode_fixtures import packed

    torch.manual_seed(0)
    config = transformers.Gemma2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       query_pre_attn_scalar=16, attn_logit_softcapping=2.0,
                                       final_logit_softcapping=30.0, sliding_window=6, initializer_range=0.3)
    eager = transformers.Gemma2ForCausalLM(config).eval()
    assert eager.config._attn_implementation == "eager"
    model = packed(eager, "avx2")
    assert model.config._attn_implementation == KERNEL_ATTENTION
    uncapped = copy.deepcopy(eager)
    for layer in uncapped.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    ids = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        reference, logits = eager(ids).logits, model(ids).logits
        assert torch.allclose(logits, reference, atol=1e-4)
        assert (uncapped(ids).logits - reference).abs().max() > 1e-2
        cache = DynamicCache(config=model.config)
        model(ids[:, :12], past_key_values=cache)
        together = model(ids[:, 12:], past_key_values=cache).logits
        cache = DynamicCache(config=model.config)
        model(ids[:, :12], past_key_values=cache)
        one_by_one = torch.cat([model(ids[:, i:i + 1], past_key_values=cache).logits for i in range(12, 20)], 1)
    assert torch.equal(together, one_by_one)
    unpack(model)
    assert model.config._attn_implementation == "eager"


def test_packed_model_verifies_with_the_bits_of_one_token_forwards(kernel):
    """The whole forward is row-exact on the AVX2 kernels: k new tokens (causal, and a tree with a sibling the
    path skips) give the logits of feeding the path one token at a time, bit for bit."""
    from transformers import DynamicCache

    from decode.backends.cpu import unpack
    from decode.engine.tree import Tree
    from decode_fixtures import packed, tiny_model

    model = packed(tiny_model(seed=8), "avx2")
    assert model.config._attn_implementation == KERNEL_ATTENTION
    ids = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(9))
    context, new = ids[:, :12], ids[:, 12:20]

    def cached(prefix):
        cache = DynamicCache(config=model.config)
        model(prefix, past_key_values=cache)
        return cache

    with torch.inference_mode():
        together = model(new, past_key_values=cached(context)).logits
        cache = cached(context)
        one_by_one = torch.cat([model(new[:, i:i + 1], past_key_values=cache).logits for i in range(8)], 1)
        assert torch.equal(together, one_by_one)
        tree = Tree()
        for token, parent in ((5, -1), (9, 0), (7, 0), (11, 2)):  # 5 -> {9, 7}, 7 -> 11: the path 5, 7, 11
            tree.add(token, parent)
        mask, positions = tree.attention_mask(12, 12, torch.float32), tree.position_ids(12, 12)
        verified = model(torch.tensor([[5, 9, 7, 11]]), past_key_values=cached(context), attention_mask=mask,
                         position_ids=positions).logits
        cache = cached(context)
        path = [model(torch.tensor([[t]]), past_key_values=cache).logits[:, 0] for t in (5, 7, 11)]
        assert all(torch.equal(verified[:, i], p) for i, p in zip((0, 2, 3), path))
        eager = tiny_model(seed=8)(torch.cat([context, new], 1)).logits[:, 12:]
        assert torch.allclose(together, eager, atol=1e-4)
    unpack(model)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("n", [1, 1000, 4099, 65536 + 17])
def test_the_stream_probe_reads_every_element_once_on_any_thread_count(kernel, n):
    """Small integers sum exactly in float32 lanes: a chunk read twice, skipped or cut wrong shows."""
    data = (torch.arange(n) % 7).float()
    threads = torch.get_num_threads()
    try:
        sums = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            sums.append(kernel.stream_sum(data))
    finally:
        torch.set_num_threads(threads)
    assert sums == [float((torch.arange(n) % 7).sum())] * 3
    with pytest.raises(RuntimeError, match="64-byte aligned float32"):
        kernel.stream_sum(torch.ones(64)[1:])


def test_the_stream_bandwidth_is_the_bytes_it_read_over_its_best_time(kernel, virtual_clock):
    """read_bandwidth with the stream probe: the probe is handed the whole buffer, aligned, and reads every float of
    it once (the sum of its ones is its length), once untimed and then `repeats` timed; the bandwidth is the bytes
    over the best of those times (durations the test writes, STREAM's rule)."""
    from decode.backends.cpu.llama import stream_kernel
    from infra.timing import read_bandwidth

    probe, name = stream_kernel()
    seen, durations = [], iter([0.5, 4.0, 1.0, 2.0])  # the first read warms up and is not timed

    def timed_probe(data: torch.Tensor) -> float:
        seen.append((data.nbytes, probe(data), data.numel()))
        virtual_clock.sleep(next(durations))
        return seen[-1][1]

    bandwidth = read_bandwidth(gib=1 / 64, repeats=3, stream=(timed_probe, name))
    assert seen == [(2**24, 2**22, 2**22)] * 4
    assert bandwidth.bytes_per_s == pytest.approx(2**24 / 1.0, rel=1e-5)
    assert name.startswith("stream_sum") and bandwidth.method.startswith(name) and bandwidth.method.endswith("of 3")


EMPTY_MODULE = """#include <Python.h>
#define INIT_OF(name) PyInit_##name
#define INIT(name) INIT_OF(name)
static PyModuleDef empty = {PyModuleDef_HEAD_INIT, "empty", nullptr, -1, nullptr};
PyMODINIT_FUNC INIT(TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&empty); }
"""


def test_a_build_killed_a_moment_ago_does_not_stall_the_next(tmp_path, monkeypatch):
    """torch's lock file, fresh, as a build killed mid-compile leaves it: the next build goes ahead (torch alone
    waits for that file to go, forever)."""
    source = tmp_path / "empty.cpp"
    source.write_text(EMPTY_MODULE)
    monkeypatch.setenv("POLYSPEC_CACHE", str(tmp_path / "cache"))
    build = build_folder((source,), ["-O0"])
    build.mkdir(parents=True)
    (build / "lock").touch()
    script = ("from pathlib import Path; from decode.backends.cpu.kernels import build_extension; "
              f"print(build_extension('empty', (Path({str(source)!r}),), ['-O0'])[0] is not None)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.stdout.split() == ["True"], done.stderr[-2000:]


def test_a_compiled_graph_calls_the_operators_through_their_c_shims(kernel):
    """inductor's C++ wrapper, under the runners' options, calls the operators' C shims directly (not boxed through
    the dispatcher by name, the cost they remove), and each shim computes what its operator does, bit for bit
    (every argument passed: attention softcapped)."""
    from torch._inductor.utils import run_and_get_cpp_code

    from decode.backends.static import compile_options

    gen = torch.Generator().manual_seed(0)
    x, weight, bias = torch.randn(3, 40, generator=gen), torch.randn(20, 40, generator=gen), torch.randn(20)
    q, k, v = (torch.randn(1, 2, rows, 16, generator=gen) for rows in (3, 9, 9))

    def forward(x, panels, q, k, v, length):
        attended = kernel.attend(q, k, v, None, 0.25, True, length, 3.0)
        return kernel.linear(x * 2, panels, 20, bias), attended + 1

    inputs = (x, kernel.pack(weight), q, k, v, torch.tensor([7]))
    compiled = torch.compile(forward, fullgraph=True, options=compile_options("inductor", torch.device("cpu")))
    with torch._inductor.config.patch(fx_graph_cache=False):
        outputs, code = run_and_get_cpp_code(compiled, *inputs)
    assert "aoti_torch_cpu_linear(" in code and "aoti_torch_cpu_attend(" in code, code[-2000:]
    assert "aoti_torch_call_dispatcher" not in code
    assert all(torch.equal(a, b) for a, b in zip(outputs, forward(*inputs), strict=True))
