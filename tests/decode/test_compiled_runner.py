"""The compiled static runners (decode.backends.static) on a CPU, the code a GPU runs but for the CUDA graph capture:
the inductor-compiled forward is the eager static runner's through rollbacks, a tree's keep and captured features, and
a mask that leaves a stale key visible fails that comparison; the target's, an int4pack W4 model's and both EAGLE
heads' forwards trace as one graph (no graph breaks); a chain decodes under the no-recompile rule with one compiled
graph per width, and a planted guard failure raises instead of recompiling; greedy chains on them (model drafters,
EAGLE-2 and EAGLE-3 chains and trees) are AR on them, a sampled chain samples like the target; `decode.backend=static`
puts every model level and head on them, and decode.costs runs on them end to end. The heavy inductor compiles are
marked slow; the rest compile through dynamo with AOTAutograd's eager backend (the same tracing, guards and
functionalization)."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from decode_fixtures import noisy_copy, prompts, tiny_model
from omegaconf import OmegaConf
from test_static_runner import TREE, VOCAB, leaky_mask, max_difference, needs_cuda, sequence
from torch._dynamo.testing import CompileCounter

import decode.backends.static as static
from decode.backends import Backend, with_lm_head
from decode.backends.cpu.int8 import Int8RowLinear
from decode.backends.cpu.llama import NativeInt8Linear
from decode.backends.cuda import StaticRunner
from decode.backends.cuda.runner import decoder_forward
from decode.backends.int4pack import Int4Linear, pack
from decode.backends.siblings import SiblingLinear, stack_siblings
from decode.backends.static import CompiledHeadRunner, CompiledRunner, head_forward
from decode.chains.baselines import autoregressive
from decode.engine.chain import Chain
from decode.engine.errors import DecodeError
from decode.engine.levels import LevelCompute, ModelLevel, NgramLevel
from decode.engine.runner import HFRunner, Prepared
from decode.settings import backend_of, decode_section
from heads.eagle import EagleHead
from heads.eagle3 import Eagle3Head

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_dynamo")
LIGHT = "aot_eager"  # dynamo + AOTAutograd without inductor's code generation: the fast tests' backend
HEADS = {"eagle": EagleHead, "eagle3": Eagle3Head}


@pytest.fixture
def fresh_dynamo():
    """Every test starts with no compiled code (another test's entries count toward the recompile limit)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0, vocab=VOCAB, layers=2)


def compiled(model, backend=LIGHT, widths=(1, 2, 4, 8)) -> Prepared:
    """`model` prepared so that every runner of it (a chain's and the AR reference's) is a CompiledRunner."""
    return Prepared(model, functools.partial(CompiledRunner, model, widths, 256, True, backend),
                    model.get_output_embeddings())


@pytest.mark.slow
def test_the_inductor_compiled_forward_is_the_eager_one_through_rollbacks_trees_and_captures(model):
    difference = max_difference(sequence(CompiledRunner(model, (1, 4), 256)), sequence(StaticRunner(model, ())))
    assert difference < 1e-4, f"the compiled forward differs from the eager one by {difference:.3g}"


def test_a_mask_that_leaves_a_stale_key_visible_is_caught(model, monkeypatch):
    """The planted bug: the mask lets the keys past a crop (or a keep) through; the comparison must fail."""
    clean = max_difference(sequence(CompiledRunner(model, (1, 4), 256, backend=LIGHT)), sequence(StaticRunner(model)))
    monkeypatch.setattr(static, "static_mask", leaky_mask(static.static_mask))
    leaked = max_difference(sequence(CompiledRunner(model, (1, 4), 256, backend=LIGHT)), sequence(StaticRunner(model)))
    assert clean < 1e-4 < 1e-3 < leaked, (clean, leaked)


def int4_model(seed: int = 0, hidden: int = 64) -> torch.nn.Module:
    """A tiny Llama whose decoder linears are Int4Linears (torch's CPU int4 kernel) of random codes, groups of 32."""
    model, gen = tiny_model(seed=seed, vocab=VOCAB, layers=2, hidden=hidden), torch.Generator().manual_seed(seed)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, linear in [(name, m) for name, m in parent.named_children() if isinstance(m, torch.nn.Linear)]:
                n, k = linear.weight.shape
                codes = torch.randint(0, 16, (n, k), generator=gen)
                scales = torch.rand(n, k // 32, generator=gen) * 0.02
                setattr(parent, name, Int4Linear(pack(codes, scales, torch.randint(0, 16, scales.shape), 32)))
    return model


@pytest.mark.parametrize("kind", ["target", "int4pack W4", "eagle", "eagle3"])
def test_the_forward_traces_as_one_graph(model, kind):
    """The target's forward with captured features, the W4 level's on torch's int4 kernel and both heads' steps."""
    ids, positions = torch.tensor([[1, 2, 3, 4]]), torch.arange(4)[None]
    if kind in ("target", "int4pack W4"):
        runner = CompiledRunner(model if kind == "target" else int4_model(), (4,), 64, backend=LIGHT)
        function, args = decoder_forward, (runner.decoder, runner.cache, ids, positions)
        last = (0, 1)
    else:
        runner = CompiledHeadRunner(HEADS[kind](model).eval(), (4,), 64, backend=LIGHT)
        function, args = head_forward, (runner.head, runner.cache, ids, positions)
        last = torch.randn(1, 4, model.config.hidden_size * (3 if kind == "eagle3" else 1))
    runner.cache.slots = torch.arange(4)
    mask = static.static_mask(None, 0, 4, runner.cache.max_length, runner.dtype)
    with torch.inference_mode():
        explained = torch._dynamo.explain(function)(*args, mask, last)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_a_chain_decodes_with_one_graph_per_width_and_a_recompile_raises(model):
    counter = CompileCounter()
    target = compiled(model, counter)
    chain = Chain([ModelLevel("t", target), NgramLevel("n", draft={"length": 5})])
    for prompt in prompts(VOCAB):
        assert chain.generate(prompt, 30).tokens == autoregressive(model, prompt, 30).tokens
    runner = chain.target.runner
    assert counter.frame_count == len(runner.warm) == len(runner.widths), (counter.frame_count, runner.warm)
    runner.layers = (0,)  # planted: a forward that is another graph, on a width already warm
    with pytest.raises(RuntimeError, match="Detected recompile"):
        runner.forward(torch.tensor([[1]]), None, None)


def test_a_compiled_forward_writes_the_kv_cache_in_place():
    """One buffer for every layer's keys and values made each layer's write, functionalized (a view of an input is
    not written in place), a copy of all of it: 2.5 s a token for the 135M default on a CPU under inductor. No
    allocation of a forward comes near the cache's size (the old cache: one the size of all of it, 6 layers here)."""
    from torch.profiler import ProfilerActivity, profile

    runner = CompiledRunner(tiny_model(seed=0, vocab=VOCAB, layers=6), (1,), 1024, backend=LIGHT)
    total = sum(buffer.nbytes for pair in runner.cache.buffers for buffer in pair)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        runner.forward(torch.tensor([[3]]), None, None)
    largest = max(event.cpu_memory_usage for event in prof.events())
    assert largest < total / 2, f"a forward allocated {largest} bytes beside a cache of {total}"


def test_the_runners_compile_limits_are_their_own(model):
    """Another library's compiled code in the process keeps torch's defaults: the runners' hard recompile limit set
    process-wide made GPTQModel's per-module dequantization (129 recompiles) raise FailOnRecompileLimitHit."""
    before = {name: getattr(torch._dynamo.config, name) for name in static.dynamo_limits()}
    chain = Chain([ModelLevel("t", compiled(model)), NgramLevel("n", draft={"length": 5})])
    chain.generate(prompts(VOCAB)[0], 10)
    assert {name: getattr(torch._dynamo.config, name) for name in before} == before

    def square(x):
        return x * x

    compiled_square = torch.compile(square, backend=LIGHT)  # recompiles at each new dtype, past a limit of 2
    with torch._dynamo.config.patch(recompile_limit=2):
        for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            assert torch.equal(compiled_square(torch.ones(2, dtype=dtype)), torch.ones(2, dtype=dtype))


@pytest.mark.parametrize("kind", HEADS)
def test_a_packed_heads_compiled_steps_read_the_keys_written_as_its_own_forward_does(model, kind):
    """Packed on the kernels, a compiled head attends on `attend` over the keys its cache holds (its key length),
    not its whole span: through a rollback its steps are its own forward's (HFHeadRunner, sdpa). A length one short
    (the newest key missed) differs; keys past the length are masked off either way."""
    from decode.backends.cpu.attention import KERNEL_ATTENTION
    from decode.engine.runner import HFHeadRunner

    head = HEADS[kind](model).eval()
    prepared = Backend("avx2", runner="static").prepare_head(copy.deepcopy(head))
    assert prepared.head.config._attn_implementation == KERNEL_ATTENTION
    runners = (CompiledHeadRunner(prepared.head, (1, 4), 64, backend=LIGHT), HFHeadRunner(head))
    gen, outs = torch.Generator().manual_seed(0), [[], []]
    for width, crop in ((3, None), (1, None), (4, 6), (2, None), (1, 7), (4, None)):
        ids = torch.randint(0, VOCAB, (1, width), generator=gen)
        features = torch.randn(1, width, head.feature_size, generator=gen)
        for runner, out in zip(runners, outs):
            if crop is not None:
                runner.crop(crop)
            out.append(runner.forward(ids, features, None, None))
    assert max_difference(*outs) < 1e-4


@pytest.mark.parametrize("kind", HEADS)
def test_a_head_runner_compiles_when_made_and_never_while_drafting(model, kind):
    """A compile in a chain's first draft landed in its timed head steps (seconds a step in decode.bench)."""
    counter, head = CompileCounter(), HEADS[kind](model).eval()
    runner = CompiledHeadRunner(head, (1, 4), 64, backend=counter)
    sizes = dict.fromkeys((head.feature_size, model.config.hidden_size))
    made = counter.frame_count
    assert made == len(runner.warm) == 2 * len(sizes) and runner.cached() == 0
    for width in (1, 3, 4, 1):
        for size in sizes:
            runner.forward(torch.ones(1, width, dtype=torch.long), torch.randn(1, width, size), None, None)
    assert counter.frame_count == made and runner.cached() == 9 * len(sizes)


@pytest.mark.slow
def test_a_greedy_lookup_chain_on_the_inductor_runner_is_ar_on_it(model):
    target = compiled(model, "inductor", widths=(1, 8))
    chain = Chain([ModelLevel("t", target), NgramLevel("n", draft={"length": 5})])
    for prompt in prompts(VOCAB):
        assert chain.generate(prompt, 30).tokens == autoregressive(target, prompt, 30).tokens


EAGLE = {"kind": "eagle", "path": "untrained"}
CHAINS = {"model, chain": [{"kind": "model", "model": "target", "layers": 1, "draft": {"length": 4}}],
          "model, tree": [{"kind": "model", "model": "target", "layers": 1, "draft": TREE}],
          "eagle, chain": [{**EAGLE, "draft": {"length": 4}}],
          "eagle, tree": [{**EAGLE, "draft": TREE}],
          "eagle3, chain": [{**EAGLE, "method": "eagle3", "draft": {"length": 4}}],
          "eagle3, tree": [{**EAGLE, "method": "eagle3", "draft": TREE}]}


@pytest.mark.parametrize("drafter", CHAINS)
def test_greedy_chains_on_it_are_ar_on_it(model, drafter):
    """Every model level on the compiled runner (a drafting model too) and every EAGLE head on the compiled head
    runner, drafting from the features handed down as today (EAGLE-3: the aux states the target's runner captures),
    their siblings stacked as the backend stacks them for these runners."""
    from decode_fixtures import build_chain

    stacked = copy.deepcopy(model)
    stack_siblings(stacked, lambda: stacked(input_ids=torch.tensor([[2, 3, 4, 5]]), use_cache=False))
    target = compiled(stacked, widths=(1, 16))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Backend, "compiled", lambda self, cuda: True)
        patch.setattr(Backend, "_runner_factory",
                      lambda self, m, compiled: functools.partial(CompiledRunner, m, (1, 16), 256, True, LIGHT))
        patch.setattr(Backend, "_head_runner_factory",
                      lambda self, head, int8, compiled: functools.partial(CompiledHeadRunner, head, (1, 16), 256,
                                                                           LIGHT))
        chain = build_chain([{"kind": "model"}, *CHAINS[drafter]], target, tokenizer=None)
    assert all(isinstance(level.runner, CompiledRunner) for level in chain.levels if isinstance(level, ModelLevel))
    assert all(isinstance(level.model.model.layers[0].mlp.up_proj, SiblingLinear)
               for level in chain.levels if isinstance(level, ModelLevel))
    if "eagle" in drafter:
        assert sum(isinstance(m, SiblingLinear) for m in chain.levels[-1].head.modules()) == 5  # q, k, v; gate, up
        assert isinstance(chain.levels[-1].runner, CompiledHeadRunner), chain.levels[-1].runner
    for prompt in prompts(VOCAB):
        result = chain.generate(prompt, 30)
        assert result.tokens == autoregressive(target, prompt, 30).tokens
    ran = [level.runner for level in result.stats.levels]  # what a report says ran each level
    assert ran == ["CompiledRunner"] * (len(ran) - 1) + [("CompiledHeadRunner" if "eagle" in drafter else ran[0])]


def test_a_stand_in_copied_before_the_target_runs_leaves_its_graphs_valid():
    """An early-exit copy shares the target's layers: hooking them again for the copy's runner changed what the
    target's compiled forward was guarded on, and its next forward raised "Detected recompile" (seen when this file's
    model, chain case ran first in its process)."""
    from decode.chains.build import truncated_copy

    target = tiny_model(seed=1, vocab=VOCAB, layers=2)
    stand_in = truncated_copy(target, 1)  # before any forward of the target
    runner = CompiledRunner(target, (1,), 64, backend=LIGHT)
    CompiledRunner(stand_in, (1,), 64, backend=LIGHT)
    runner.forward(torch.tensor([[1]]), None, None)  # warm: a changed guard raises here


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma2"])
def test_the_compiled_forward_masks_sliding_windows_as_hf_runner_does(family):
    from test_static_runner import windowed_model

    model = windowed_model(family)
    difference = max_difference(sequence(CompiledRunner(model, (1, 4), 64, backend=LIGHT)), sequence(HFRunner(model)))
    assert difference < 1e-5, f"the compiled forward differs from HFRunner's by {difference:.3g}"


def test_a_runner_never_runs_another_modules_graphs(model):
    """The runners skip guards on their module (its tensors and attributes): a second model of the same shapes but
    another function (here one layer's activation) would pass every guard left, so its runner must hold compiled
    entries of its own, and runs its own function; a second runner of the same model shares the first one's."""
    other = copy.deepcopy(model)
    other.model.layers[0].mlp.act_fn = torch.nn.GELU()
    counter = CompileCounter()
    first = CompiledRunner(model, (1, 4), 256, backend=counter)
    CompiledRunner(model, (1, 4), 256, backend=counter)
    assert counter.frame_count == 2  # one graph a width, for both runners of `model`
    mine, theirs = sequence(CompiledRunner(other, (1, 4), 256, backend=counter)), sequence(first)
    assert max_difference(mine, sequence(StaticRunner(other))) < 1e-5
    assert max_difference(mine, theirs) > 1e-3


@pytest.mark.slow
def test_a_sampled_chain_on_it_samples_like_the_target():
    from test_sampling_distribution import VOCAB as V, chain_counts, chi_square_pvalue, exact_joint

    target = tiny_model(seed=3, vocab=V, layers=2, hidden=32, init=0.3)
    middle = tiny_model(seed=11, vocab=V, layers=2, hidden=32, init=0.3)
    drafter = noisy_copy(middle, 0.5, seed=5)
    for m in (target, middle, drafter):  # as the backend runs these runners' models: siblings stacked
        assert stack_siblings(m, lambda m=m: m(input_ids=torch.tensor([[1, 2]]), use_cache=False)) == 4
    levels = [ModelLevel(name, m, compute=LevelCompute(CompiledRunner(m, (1, 2, 4), 32, backend=LIGHT)), **kw)
              for name, m, kw in (("target", target, {}), ("middle", middle, {"mu": 2}),
                                  ("drafter", drafter, {"draft": {"length": 2}}))]
    p = chi_square_pvalue(chain_counts(Chain(levels)), exact_joint(target))
    assert p > 1e-3, f"sampling through the compiled runner differs from the target's (chi-square p={p:.2e})"


def test_the_backend_setting_puts_every_model_level_on_it(model):
    def backend(value: str) -> Backend:
        section = decode_section(OmegaConf.create({"decode": {"backend": value, "fast": True}}))
        return backend_of(section, torch.device("cpu"))

    chosen = backend("static")
    assert (chosen.runner, chosen.gemm, chosen.native_fp32) == ("static", "auto", "off")  # packed: the kernels
    assert chosen.prepare(model).new_runner.func is CompiledRunner  # made, it would compile every width
    assert chosen.drafting(chosen.prepare(model)).prepare(model).new_runner.func is CompiledRunner
    assert chosen.prepare_head(EagleHead(model).eval()).new_runner.func is CompiledHeadRunner
    ahead = backend("aoti")  # the same runners, compiled by AOTInductor
    assert (ahead.runner, ahead.gemm, ahead.native_fp32) == ("aoti", "auto", "off")
    assert ahead.prepare(model).new_runner.keywords == {"backend": "aoti"}
    assert backend("auto").compiler(cuda=False) == "aoti" and backend("auto").compiler(cuda=True) == "inductor"
    assert ahead.prepare_head(EagleHead(model).eval()).new_runner.keywords == {"backend": "aoti"}
    assert chosen.prepare(model).new_runner.keywords == {"backend": "inductor"}
    int8_head = with_lm_head(ahead.prepare(copy.deepcopy(model)), Int8RowLinear(copy.deepcopy(model.lm_head)))
    assert isinstance(int8_head.lm_head, NativeInt8Linear)  # lm_head: int8 on the native kernel, as beside native
    assert backend("auto").runner == "auto" and backend("auto").gemm is not None  # a CPU's fast path, as before
    assert backend("eager").gemm is not None and not backend("eager").compiled(cuda=True)
    assert backend("auto").compiled(cuda=True) and not backend("auto").compiled(cuda=False)
    with pytest.raises(DecodeError, match="decode.backend must be one of auto, static, aoti, eager, got 'graphs'"):
        backend("graphs")


def test_inductor_caches_under_the_projects_cache_dir_unless_told_otherwise(model, monkeypatch, tmp_path):
    """Inductor sets TORCHINDUCTOR_CACHE_DIR to its default the first time it is asked for its cache, which imports
    do before any runner is made: taken as the user's choice, the project's cache dir was never used."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

    from data.models import cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    inductor_cache_dir()  # as an import does
    static.compiled_for(model, decoder_forward, LIGHT, torch.device("cpu"))
    assert inductor_cache_dir() == str(cache_dir() / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    static.compiled_for(model, decoder_forward, LIGHT, torch.device("cpu"))
    assert inductor_cache_dir() == str(tmp_path)


@pytest.mark.slow
def test_decode_costs_times_the_target_on_it_with_the_static_backend(tiny_source, chat_file, tmp_path):
    """The app end to end on the GPU's code path (decode.backend=static on a CPU): its target row is the compiled
    runner's forward, whose launches it counts."""
    import json
    import os
    import subprocess
    import sys

    small = ["decode.costs.ks=[1,2]", "decode.costs.repeats=1", "decode.costs.context=32", "decode.costs.head_vocab=[]",
             "decode.costs.round_tokens=8"]
    done = subprocess.run(
        [sys.executable, "-m", "decode.costs", f"run_dir={tmp_path}", f"model.name={tiny_source}",
         f"data.source={chat_file}", "data.held_out_fraction=0.25", "decode.backend=static", *small],
        capture_output=True, text=True, timeout=1200,
        env={**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    costs = json.loads((tmp_path / "costs.json").read_text())
    assert "CompiledRunner (decode.backend)" in json.dumps(costs)
    # q/k/v and gate/up stacked on the compiled runner: 4 products a layer and the LM head's, against 7 and 1
    launched = costs["launches"]
    assert (launched["target"]["products"], launched["target eager"]["products"]) == (9, 15)
    # and norms, rotary, activations and residuals fused: under half the launches of transformers' eager forward
    assert 9 < launched["target"]["kernels"] < launched["target eager"]["kernels"] / 2, launched


@pytest.mark.gpu
@needs_cuda
def test_the_captured_compiled_forward_is_the_compiled_one_on_cuda(model):
    """CUDA graphs captured around the inductor-compiled forward replay what it computes, through rollbacks, a tree's
    keep and captured features (bf16), one graph per width and feature set."""
    on_gpu = copy.deepcopy(model).to("cuda", torch.bfloat16)
    graphs, plain = CompiledRunner(on_gpu, (1, 4), 256), CompiledRunner(on_gpu, (1, 4), 256, graphs=False)
    difference = max_difference(sequence(graphs), sequence(plain))
    assert difference <= 1e-3, f"graph replay differs from the compiled forward by {difference:.3g}"
    assert len(graphs.graphs) == 2 and not plain.graphs  # the widths with captured features (the earlier dropped)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", HEADS)
def test_a_heads_captured_steps_are_its_compiled_ones_on_cuda(model, kind):
    """A head runner on CUDA replays a graph per width and feature size, computing what its compiled step does."""
    head = HEADS[kind](copy.deepcopy(model).to("cuda", torch.bfloat16)).to("cuda", torch.bfloat16).eval()
    graphs, plain = CompiledHeadRunner(head, (1, 4), 64), CompiledHeadRunner(head, (1, 4), 64, graphs=False)
    sizes = dict.fromkeys((head.feature_size, model.config.hidden_size))
    assert len(graphs.graphs) == 2 * len(sizes) and not plain.graphs  # captured when made, as compiled
    gen = torch.Generator().manual_seed(0)
    for width, size in ((3, head.feature_size), (1, model.config.hidden_size), (4, model.config.hidden_size)):
        ids = torch.randint(0, VOCAB, (1, width), generator=gen).cuda()
        features = torch.randn(1, width, size, generator=gen).to("cuda", torch.bfloat16)
        out = [runner.forward(ids, features, None, None).float() for runner in (graphs, plain)]
        assert (out[0] - out[1]).abs().max().item() <= 1e-3
