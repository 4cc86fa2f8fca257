"""The compiled static runners compiled ahead of time (decode.backends.aoti, `decode.backend=aoti`): the forward is
the eager static runner's through rollbacks, a tree's keep and captured features (the KV buffers written in place by
the library, the module's tensors handed to it by name); on the project's kernels (packed linears, kernel attention)
a greedy EAGLE chain, target and head on it, is AR on it; each shape compiles once, and a library compiled once is
loaded from disk by another model of the same shapes, reading that model's weights. AOTInductor compiles take seconds
each even for a tiny model: slow."""
from __future__ import annotations

import functools

import pytest
import torch
from decode_fixtures import build_chain, prompts, tiny_model
from test_static_runner import TREE, VOCAB, max_difference, sequence

import decode.backends.aoti as aoti
from decode.backends import Backend
from decode.backends.cuda import StaticRunner
from decode.backends.static import CompiledHeadRunner, CompiledRunner
from decode.chains.baselines import autoregressive

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0, vocab=VOCAB, layers=2)


def test_the_ahead_of_time_forward_is_the_eager_one_through_rollbacks_trees_and_captures(model):
    difference = max_difference(sequence(CompiledRunner(model, (1, 4), 256, backend="aoti")),
                                sequence(StaticRunner(model, ())))
    assert difference < 1e-4, f"the AOTInductor forward differs from the eager one by {difference:.3g}"


def test_a_library_reading_the_wrong_tensor_for_a_constant_is_caught(model, monkeypatch):
    """The planted bug: lifted tensors (the packed weights) handed to the library in another order than the
    program's, among tensors of one shape (so that no kernel's shape check notices: layer 0's for layer 1's)."""
    right = aoti.library_constants

    def shuffled(program, module):
        constants, alike = right(program, module), {}
        for name in sorted(n for n in constants if n.startswith("_tensor_constant")):
            alike.setdefault(constants[name].shape, []).append(name)
        return constants | {a: constants[b] for names in alike.values() for a, b in zip(names, names[1:] + names[:1])}

    def packed():  # a module of its own: runners of one module share its libraries
        return Backend("avx2", runner="aoti").prepare(tiny_model(seed=0, vocab=VOCAB, layers=2)).model

    clean = sequence(CompiledRunner(packed(), (1, 4), 256, backend="aoti"))
    monkeypatch.setattr(aoti, "library_constants", shuffled)
    wrong = sequence(CompiledRunner(packed(), (1, 4), 256, backend="aoti"))
    assert max_difference(clean, sequence(StaticRunner(packed(), ()))) < 1e-4 < max_difference(clean, wrong)


def test_a_greedy_eagle_tree_on_the_kernels_is_ar_and_compiles_each_shape_once():
    """Target and head on the project's kernels (decode.backend=aoti with fast), the head drafting a tree."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Backend, "_runner_factory", lambda self, m, compiled: functools.partial(
            CompiledRunner, m, (1, 8), 256, True, "aoti"))
        patch.setattr(Backend, "_head_runner_factory", lambda self, head, int8, compiled: functools.partial(
            CompiledHeadRunner, head, (1, 8), 256, "aoti"))
        target = Backend("avx2", runner="aoti").prepare(tiny_model(seed=0, vocab=VOCAB, layers=2))
        chain = build_chain([{"kind": "model"}, {"kind": "eagle", "path": "untrained", "draft": TREE}], target,
                            tokenizer=None, gemm="avx2")
        for prompt in prompts(VOCAB)[:2]:
            assert chain.generate(prompt, 24).tokens == autoregressive(target, prompt, 24).tokens
    for level in chain.levels:  # the target's widths 1 and 8; the head's the same, for its own feature size
        assert isinstance(level.runner.compiled, aoti.AheadOfTime)
        assert len(level.runner.compiled.libraries) == 2, list(level.runner.compiled.libraries)


def test_another_model_of_the_same_shapes_loads_the_compiled_library_from_disk_with_its_own_weights(monkeypatch):
    """Guards two bugs: a key that differs between two exports of one program (the cache never hits: a compile here
    raises) and a library that baked the first model's weights in (the second model's forward would be the first's)."""
    sequence(CompiledRunner(tiny_model(seed=0, vocab=VOCAB, layers=2), (4,), 256, backend="aoti"))

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled again: the disk cache missed")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", no_compile)
    other = tiny_model(seed=1, vocab=VOCAB, layers=2)
    assert max_difference(sequence(CompiledRunner(other, (4,), 256, backend="aoti")),
                          sequence(StaticRunner(other, ()))) < 1e-4


def test_a_library_compiled_where_inductor_freezes_still_reads_the_weights_it_is_handed(monkeypatch, tmp_path):
    """GPTQModel's int4 linear sets inductor's process-wide `freezing` and `max_autotune`: a library compiled then had
    the first model's weights frozen into it and asked for them by names no other process hands over (KeyError)."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(aoti, "cache_dir", lambda: tmp_path)
    with monkeypatch.context() as frozen:
        frozen.setattr(inductor_config, "freezing", True)
        frozen.setattr(inductor_config, "max_autotune", True)
        sequence(CompiledRunner(tiny_model(seed=0, vocab=VOCAB, layers=2), (4,), 256, backend="aoti"))
    other = tiny_model(seed=1, vocab=VOCAB, layers=2)
    assert max_difference(sequence(CompiledRunner(other, (4,), 256, backend="aoti")),
                          sequence(StaticRunner(other, ()))) < 1e-4


def test_the_library_key_names_the_vector_isa_the_options_and_the_shapes(monkeypatch):
    """A cache dir shared by an AVX-512 host and an AVX2 one (or ATEN_CPU_CAPABILITY=avx2) must not hand one the
    other's library; nor may other options or another shape find it."""
    import torch._inductor.cpu_vec_isa as isa

    def key(rows: int, options: dict) -> str:
        return aoti.program_key(torch.export.export(torch.nn.Linear(8, 8), (torch.ones(rows, 8),)), options)

    here = key(2, {})
    assert here == key(2, {}) and here not in (key(3, {}), key(2, {"max_autotune": True}))
    monkeypatch.setattr(isa, "pick_vec_isa", lambda: "another ISA")
    assert key(2, {}) != here
