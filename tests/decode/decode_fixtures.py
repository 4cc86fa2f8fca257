"""Tiny random models shared by the decode tests (not a test module); the checks are in tests/lossless_fixtures.py."""
from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from decode.engine.runner import Prepared, as_prepared


def tiny_model(seed: int = 0, vocab: int = 300, layers: int = 4, hidden: int = 64,
               init: float = 0.08) -> LlamaForCausalLM:
    """A tiny random Llama in fp32. A larger init than HF's 0.02 gives peaked next-token distributions,
    so near-ties (which may legitimately flip an argmax) stay rare."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
        initializer_range=init,
    )
    return LlamaForCausalLM(config).eval()


def noisy_copy(model: PreTrainedModel | Prepared, noise: float, seed: int = 1) -> PreTrainedModel:
    """The model (any family) with Gaussian noise on every weight, plain: a drafter that agrees often but not
    always."""
    model = as_prepared(model).model
    clone = type(model)(model.config).eval()
    clone.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in clone.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise * p.std().clamp(min=1e-3))
    return clone


def packed(model: LlamaForCausalLM, gemm: str = "auto") -> LlamaForCausalLM:
    """A copy of the model whose linears run through decode.fast's packed weights (`gemm`: auto, avx2, onednn)."""
    import copy

    from decode.backends.cpu import pack

    clone = copy.deepcopy(model)
    assert pack(clone, gemm) > 0, f"no packed product ({gemm}) runs in this torch build"
    return clone


def native(model: LlamaForCausalLM) -> Prepared:
    """A copy of the model prepared to run the native runner (packed on avx2): every runner of it, a chain level's
    and the autoregressive reference's alike, runs decode/backends/cpu/decoder.cpp (skips where it does not build)."""
    import pytest

    from decode.backends import Backend
    from decode.backends.cpu.llama import native_kernels

    if native_kernels()[0] is None:
        pytest.skip(f"the native kernels do not build here: {native_kernels()[1]}")
    return Backend("avx2", native_fp32="on").prepare(copy.deepcopy(model))


def prompts(vocab: int, n: int = 3, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        body = torch.randint(0, vocab, (6 + 5 * i,), generator=gen).tolist()
        out.append(body + body[:4] + body)  # repeats give prompt lookup something to find
    return out


def build_chain(levels: list[dict], target, tokenizer, artifacts=None, gemm: str | None = None,
                draft_defaults: dict | None = None, head: torch.nn.Module | None = None):
    """A chain from a level list (conf/decode/chain.yaml's form; decode.engine.spec.LevelSpec documents the keys),
    through the ChainBuilder the apps use, on a backend that packs with `gemm` (None: nothing packed, but avx2 beside
    a target on the native runner, as the apps run a native target's drafters). `head`: the module every eagle level
    loads, prepared by the builder's backend as a loaded one is (None: as the level's spec says)."""
    import pytest

    from decode.backends import Backend, runs_natively
    from decode.chains import build
    from decode.engine.spec import ChainSpec

    if gemm is None and isinstance(target, Prepared) and runs_natively(target):
        gemm = "avx2"
    builder = build.ChainBuilder(target, tokenizer, artifacts, build.LevelSettings(backend=Backend(gemm)))
    with pytest.MonkeyPatch.context() as patch:
        if head is not None:
            patch.setattr(build, "_eagle_head", lambda *args: head)
        return builder.build(ChainSpec.parse(levels, draft_defaults))
