"""Every stage on CUDA (`device=cuda`): lossless decoding on the GPU (greedy equal to AR on the same device and dtype,
sampling distributed as the target's), train.eagle with NCCL (one GPU, and torchrun over two when there are two),
quantize.w4 through GPTQModel's GPU path writing the CPU path's checkpoint format. Marked `gpu`; without CUDA every
test here is skipped with the reason (scripts/gpu.sh runs them on a GPU machine)."""
from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from decode_fixtures import greedy_equal, noisy_copy, prompts, tiny_model
from omegaconf import OmegaConf
from test_quantize_w4 import chat_file, stage_config, tiny_source  # noqa: F401 (fixtures)
from test_sampling_distribution import SAMPLING, VOCAB as SAMPLING_VOCAB, chain_counts, chi_square_pvalue, exact_joint
from test_train_eagle import REPO, compose, head_weights, overrides, tiny_setup  # noqa: F401 (fixtures)

from data.device import resolve_device
from data.errors import ConfigError
from decode.build import build_chain
from decode.engine.chain import Chain
from decode.engine.levels import ModelLevel

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")]

VOCAB = 300
TREE = {"mode": "tree", "depth": 4, "top_k": 3, "total_tokens": 10}
CHAINS = {
    "model drafter, chain": [{"kind": "model"}, {"kind": "model", "model": "target", "layers": 2, "draft": {"length": 4}}],
    "3 levels, tree, mu 3": [{"kind": "model"}, {"kind": "model", "model": "target", "layers": 3, "mu": 3},
                             {"kind": "model", "model": "target", "layers": 1, "draft": TREE}],
    "eagle chain": [{"kind": "model"}, {"kind": "eagle", "path": "untrained", "draft": {"length": 4}}],
    "eagle tree, nearest features": [{"kind": "model"}, {"kind": "model", "model": "target", "layers": 3, "mu": 2},
                                     {"kind": "eagle", "path": "untrained", "features": "nearest", "draft": TREE}],
    "prompt lookup": [{"kind": "model"}, {"kind": "ngram", "draft": {"length": 5}}],
}


def test_device_resolution_with_cuda(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert resolve_device("auto") == resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match="CUDA device"):
        resolve_device(f"cuda:{torch.cuda.device_count()}")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("shape", CHAINS)
def test_greedy_chain_equals_ar_on_cuda(shape, dtype, tol):
    """Token for token against KV-cached AR of the same target on the same GPU in the same dtype; as on the CPU
    (tests/test_lossless_greedy.py), a divergence passes only at a near-tie of the target's top-2 logits (`tol`,
    relative: bf16 rounds a verification of k tokens differently from k single-token forwards)."""
    target = tiny_model(seed=0, vocab=VOCAB).to("cuda", dtype)
    chain = build_chain(CHAINS[shape], target, tokenizer=None)
    assert all(level.device.type == "cuda" for level in chain.levels if hasattr(level, "device"))
    ties = 0
    for prompt in prompts(VOCAB):
        generation = chain.generate(prompt, 40)
        ok, tie = greedy_equal(target, prompt, generation.tokens, tol)
        assert ok and len(generation.tokens) == 40, f"{shape} ({dtype}): differs from AR on the same GPU at a clear margin"
        ties += tie
    assert ties <= 1, f"{shape} ({dtype}): {ties} near-ties in 3 prompts"


@pytest.fixture(scope="module")
def cuda_trio():
    target = tiny_model(seed=3, vocab=SAMPLING_VOCAB, layers=2, hidden=32, init=0.3)
    middle = tiny_model(seed=11, vocab=SAMPLING_VOCAB, layers=2, hidden=32, init=0.3)
    return target, tuple(copy.deepcopy(m).to("cuda") for m in (target, middle, noisy_copy(middle, 0.5, seed=5)))


def test_three_level_chain_samples_like_the_target_on_cuda(cuda_trio):
    """The chi-square test of tests/test_sampling_distribution.py with every level on the GPU (a CUDA generator)."""
    cpu_target, (target, middle, drafter) = cuda_trio
    chain = Chain([ModelLevel("target", target), ModelLevel("middle", middle, mu=2),
                   ModelLevel("drafter", drafter, draft={"mode": "chain", "length": 2})])
    p = chi_square_pvalue(chain_counts(chain), exact_joint(cpu_target))
    assert p > 1e-3, f"chain sampling on CUDA differs from the target's (chi-square p={p:.2e}, T={SAMPLING.temperature})"


def test_train_eagle_on_cuda_writes_a_loadable_head(tiny_setup, tmp_path):
    """One GPU, NCCL, bf16 head weights: a head that the chain loads on the GPU and drafts with."""
    import train.eagle as eagle
    from decode.engine.head import EagleHead
    from data.models import load_model

    metrics = eagle.train(compose(tiny_setup, tmp_path, "device=cuda", "train.epochs=1", "train.precision=bf16"))
    assert metrics["train/steps"] > 0 and metrics["train/tokens_per_s"] > 0
    assert {t.dtype for t in head_weights(tmp_path).values()} == {torch.bfloat16}
    target, tokenizer = load_model(str(tiny_setup / "target"), "float32", "cuda")
    head = EagleHead.from_pretrained(tmp_path / "eagle", target, tokenizer)
    assert next(head.parameters()).device.type == "cuda"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_gpu_torchrun_matches_one_gpu_with_the_same_global_batch(tiny_setup, tmp_path):
    """As the gloo test in test_train_eagle.py, over NCCL: 2 GPUs x accum 1 vs 1 GPU x accum 2."""
    env = {**os.environ, "WANDB_MODE": "disabled"}
    common = ["device=cuda", "train.epochs=1", "train.max_conversations=24", "train.zero_stage=2"]
    single = subprocess.run([sys.executable, "-m", "train.eagle", *overrides(tiny_setup, tmp_path / "one", *common, "train.grad_accum=2")],
                            cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert single.returncode == 0, single.stderr[-2000:]
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    double = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}", "-m", "train.eagle",
         *overrides(tiny_setup, tmp_path / "two", *common, "train.grad_accum=1")],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert double.returncode == 0, double.stderr[-2000:]
    one = json.loads((tmp_path / "one" / "eagle" / "metrics.json").read_text())
    two = json.loads((tmp_path / "two" / "eagle" / "metrics.json").read_text())
    assert one["train/steps"] == two["train/steps"] and two["train/world_size"] == 2
    assert two["train/loss"] == pytest.approx(one["train/loss"], rel=1e-3)
    w1, w2 = head_weights(tmp_path / "one"), head_weights(tmp_path / "two")
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=0, atol=1e-3)


def test_quantize_w4_on_cuda_writes_the_cpu_checkpoint_format(tiny_source, chat_file, tmp_path):  # noqa: F811
    """GPTQModel's GPU path: the same tensors (names, shapes, dtypes) and quantization config as the CPU path."""
    from safetensors import safe_open

    from quantize.w4 import run

    outputs = {}
    for device in ("cpu", "cuda"):
        cfg = stage_config(tiny_source, chat_file, tmp_path / device)
        OmegaConf.update(cfg, "device", device)
        outputs[device] = run(cfg)
    layouts = {}
    for device, out in outputs.items():
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            layouts[device] = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    assert layouts["cuda"] == layouts["cpu"]
    quant = {d: json.loads((out / "config.json").read_text())["quantization_config"] for d, out in outputs.items()}
    assert {k: v for k, v in quant["cuda"].items() if k != "meta"} == {k: v for k, v in quant["cpu"].items() if k != "meta"}
    assert json.loads((outputs["cuda"] / "metrics.json").read_text())["device"].startswith("cuda")
