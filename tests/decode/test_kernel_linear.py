"""A GPTQ W4 model on the project's int4 tiles as torch operators (decode.backends.cpu.kernel_linear), the compiled
static runner's W4 level on a CPU: every swapped linear computes the native runner's product bit for bit (siblings
stacked), the state_dict is unchanged, the static runner takes the model only once no GPTQModel kernel is left, its
forward traces as one graph, and a greedy chain on it is AR on it."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from test_native_w4 import text, w4, w4_folder  # noqa: F401
from torch._dynamo.testing import CompileCounter

from decode.backends.cpu import pack
from decode.backends.cpu.kernel_linear import KernelLinear, int4_on_kernels, is_cpu_int4
from decode.backends.cpu.llama import native_kernels, w4_siblings
from decode.backends.cuda.runner import unsupported
from decode.backends.static import CompiledRunner
from decode.chains.baselines import autoregressive
from decode.engine.chain import Chain
from decode.engine.levels import ModelLevel, NgramLevel
from decode.engine.runner import Prepared

pytestmark = [pytest.mark.cpu_kernels, pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(native_kernels()[0] is None, reason="the native kernels do not build here")]


def on_kernels(model: torch.nn.Module, activations: str) -> torch.nn.Module:
    moved = copy.deepcopy(model)
    assert int4_on_kernels(moved, activations) == sum(is_cpu_int4(m) for m in model.modules()) > 0
    return moved


@pytest.mark.parametrize("activations", ["int8", "fp32"])
def test_every_swapped_linear_is_the_native_product_bit_for_bit(w4, activations):  # noqa: F811
    moved = on_kernels(w4, activations)
    assert moved.state_dict().keys() == w4.state_dict().keys()
    kernels, x = native_kernels()[0], torch.randn(5, w4.config.hidden_size, generator=torch.Generator().manual_seed(0))
    stacked = 0
    for name, module in w4.named_modules():
        if not is_cpu_int4(module) or module.in_features != x.shape[1]:
            continue
        swapped = moved.get_submodule(name)
        assert isinstance(swapped, KernelLinear)
        native = kernels.packed_mm(x, w4_siblings(kernels, [module], activations)[0])
        if swapped.sibling is None:
            assert torch.equal(swapped(x), native), name
        else:  # its slice of the stacked product: the same chains over the same weights
            group, index = swapped.sibling
            out = group.run(x)[:, group.bounds[index]: group.bounds[index + 1]]
            assert torch.equal(out, native), name
            stacked += 1
    assert stacked > 0  # q/k/v and gate/up found by tracing


def test_the_static_runner_takes_a_w4_model_only_on_the_kernels(w4):  # noqa: F811
    assert "quantized weights" in unsupported(w4)
    moved = on_kernels(w4, "int8")
    assert unsupported(moved) is None
    moved.model.layers[0].mlp.down_proj = w4.model.layers[0].mlp.down_proj  # planted: one GPTQModel linear left
    assert "quantized weights" in unsupported(moved)


def test_a_greedy_chain_on_the_compiled_w4_runner_is_ar_on_it(w4):  # noqa: F811
    model = on_kernels(w4, "int8")
    pack(model, "avx2")
    counter = CompileCounter()
    runner = functools.partial(CompiledRunner, model, (1, 2, 4, 8), 128, True, counter)
    prepared = Prepared(model, runner, model.get_output_embeddings())
    prompt = text(12, seed=3)[0].tolist()
    chain = Chain([ModelLevel("w4", prepared), NgramLevel("n", draft={"length": 5})])
    assert chain.generate(prompt, 24).tokens == autoregressive(prepared, prompt, 24).tokens
    assert counter.frame_count == 4  # one graph per width, traced whole: no graph break on the operators



@pytest.mark.slow
def test_a_greedy_chain_on_the_ahead_of_time_w4_runner_is_ar_on_it(w4):  # noqa: F811
    """The int4 tiles (int8 activations) called from an AOTInductor library (decode.backend=aoti)."""
    model = on_kernels(w4, "int8")
    pack(model, "avx2")
    prepared = Prepared(model, functools.partial(CompiledRunner, model, (1, 8), 128, True, "aoti"),
                        model.get_output_embeddings())
    prompt = text(12, seed=3)[0].tolist()
    chain = Chain([ModelLevel("w4", prepared), NgramLevel("n", draft={"length": 5})])
    assert chain.generate(prompt, 24).tokens == autoregressive(prepared, prompt, 24).tokens
    assert any(isinstance(m, KernelLinear) for m in model.modules())
