"""The W4 level on torch's own int4 kernels (decode/backends/int4pack.py): real GPTQ checkpoints of a tiny Llama
(symmetric and asymmetric, each in GPTQ's v1 and v2 zero-point conventions) dequantize to GPTQModel's own weights, the
CUDA layout fits tinygemm's shape rules (under fake tensors, no GPU), a greedy chain on the level is the target's, and
(slow) the real default's W4 level agrees with GPTQModel's forward on real text. Also the CUDA build of every default
chain: int8 weights fall back there, said in one line."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import AutoModelForCausalLM, AutoTokenizer, GPTQConfig, LlamaForCausalLM
from w4_fixtures import REPO, held_out_text, stage_config

from decode.backends import Backend, int8_fallback
from decode.backends import int4pack
from decode.backends.cuda.runner import unsupported as static_unsupported
from decode.backends.int4pack import Int4Linear, cuda_shape_problem, dequantized, inner_k_tiles, load_int4pack, pack
from decode.engine.runner import HFRunner
from decode.engine.spec import ChainSpec

CHECKPOINTS = [("sym", "gptq"), ("sym", "gptq_v2"), ("asym", "gptq"), ("asym", "gptq_v2")]


@pytest.fixture(scope="module")
def v1_folders(tiny_source, chat_file, tmp_path_factory) -> dict[str, Path]:
    """The tiny Llama through quantize.w4 (GPTQModel, v1 checkpoints: `checkpoint_format: gptq`), sym and asym."""
    from quantize.settings import w4_of
    from quantize.w4 import run

    return {kind: run(w4_of(stage_config(tiny_source, chat_file, tmp_path_factory.mktemp(kind), sym=kind == "sym")))
            for kind in ("sym", "asym")}


def as_v2(folder: Path, out: Path) -> Path:
    """A v1 checkpoint rewritten in GPTQ's v2 convention: every packed zero-point word + 0x11111111 (as GPTQModel
    converts v1 when it loads one), `checkpoint_format: gptq_v2`."""
    shutil.copytree(folder, out)
    for file in out.glob("*.safetensors"):
        tensors = load_file(file)
        for key in [k for k in tensors if k.endswith(".qzeros")]:
            tensors[key] = (tensors[key].long() + 0x11111111).to(torch.int64).bitwise_and(0xFFFFFFFF).to(torch.int32)
        save_file(tensors, file, metadata={"format": "pt"})
    for name, key in (("config.json", "quantization_config"), ("quantize_config.json", None)):
        config = json.loads((out / name).read_text())
        (config[key] if key else config)["checkpoint_format"] = "gptq_v2"
        (out / name).write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def checkpoints(v1_folders, tmp_path_factory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("v2")
    return {(kind, fmt): folder if fmt == "gptq" else as_v2(folder, root / kind)
            for kind, folder in v1_folders.items() for fmt in ("gptq", "gptq_v2")}


def gptqmodel(folder: Path, backend: str = "torch") -> torch.nn.Module:
    """The checkpoint as GPTQModel loads it (through transformers): `torch` is its reference kernel (the dequantized
    weight in the model's dtype), `torch_fused` the CPU int4 kernel polyspec's GPTQModel W4 levels run."""
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=GPTQConfig(bits=4, backend=backend),
                                                dtype=torch.float32).eval()


def dequantization_error(folder: Path) -> float:
    """The largest difference between an Int4Linear's dequantized weight and GPTQModel's own dequantization of the
    same linear (its `dequantize_weight`, computed in float32: in its fp16 scales it rounds s * (q - z) to fp16)."""
    ours, theirs, worst = load_int4pack(folder), gptqmodel(folder), 0.0
    for name, module in ours.named_modules():
        if isinstance(module, Int4Linear):
            reference = theirs.get_submodule(name)
            reference.scales = reference.scales.float()
            worst = max(worst, (dequantized(module) - reference.dequantize_weight().t()).abs().max().item())
    return worst


@pytest.mark.parametrize("kind, fmt", CHECKPOINTS, ids=[f"{k}-{f}" for k, f in CHECKPOINTS])
def test_dequantized_weights_are_gptqmodels(checkpoints, kind, fmt):
    folder = checkpoints[kind, fmt]
    assert json.loads((folder / "config.json").read_text())["quantization_config"]["checkpoint_format"] == fmt
    assert dequantization_error(folder) <= 1e-5


def test_the_asymmetric_checkpoints_have_their_own_zero_points(checkpoints):
    """Otherwise the asym cases above would check the symmetric arithmetic twice."""
    for fmt in ("gptq", "gptq_v2"):
        zeros = [m.scales_and_zeros[..., 1] for m in load_int4pack(checkpoints["asym", fmt]).modules()
                 if isinstance(m, Int4Linear)]
        assert all(z.abs().max() > 0 for z in zeros)
    sym = [m.scales_and_zeros[..., 1] for m in load_int4pack(checkpoints["sym", "gptq"]).modules()
           if isinstance(m, Int4Linear)]
    assert all(torch.equal(z, torch.zeros_like(z)) for z in sym)


@pytest.mark.parametrize("kind", ["sym", "asym"])
def test_a_zero_point_off_by_one_fails_the_dequantization_check(checkpoints, kind, monkeypatch):
    """Planted: v1 read as v2 (the stored z - 1 taken for z)."""
    monkeypatch.setattr(int4pack, "ZERO_OFFSET", {"gptq": 0, "gptq_v2": 0})
    assert dequantization_error(checkpoints[kind, "gptq"]) > 1e-3


def test_checkpoints_the_kernels_cannot_take_are_refused_in_one_line(checkpoints, tmp_path):
    folder = shutil.copytree(checkpoints["sym", "gptq"], tmp_path / "act_order")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["desc_act"] = True
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"desc_act: true .*static groups") as err:
        load_int4pack(folder)
    assert "\n" not in str(err.value)
    permuted = torch.arange(192).flip(0) // 64  # what activation order makes of g_idx
    qweight, qzeros = torch.zeros(24, 8, dtype=torch.int32), torch.zeros(3, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="not static 64-wide groups"):
        int4pack.gptq_parts(qweight, qzeros, torch.ones(3, 8), permuted.int(), 64, 1)


def fake_cuda_linear(n: int, k: int, group_size: int) -> tuple[Int4Linear, torch.Tensor]:
    """An Int4Linear packed for CUDA and its output for 5 tokens, as fake tensors (shapes only: in FakeTensorMode)."""
    codes = torch.empty(n, k, dtype=torch.int32, device="cuda")
    scales = torch.empty(n, k // group_size, dtype=torch.float16, device="cuda")
    linear = Int4Linear(pack(codes, scales, torch.empty_like(scales), group_size))
    return linear, linear(torch.empty(5, k, device="cuda"))


# Every quantized linear's (outputs, inputs) in the tiny test model and in the real default (SmolLM2-135M: hidden 576,
# 3 K/V heads of 64, MLP 1536; stored groups 64 wide)
SHAPES = [(192, 192), (96, 192), (384, 192), (192, 384), (576, 576), (192, 576), (1536, 576), (576, 1536)]


@pytest.mark.parametrize("n, k", SHAPES)
def test_the_cuda_layout_fits_tinygemm_under_fake_tensors(n, k):
    """torch's meta kernels give the packed weight [n / 8, k / (tiles * 16), 32, tiles / 2] and the product [m, n]
    only where n is a multiple of 8 and the inner k tiles divide k / 16 (else they floor silently, which is why
    `pack` checks tinygemm's rules first)."""
    assert cuda_shape_problem(n, k, 64) is None
    tiles = inner_k_tiles(k)
    with FakeTensorMode():
        linear, out = fake_cuda_linear(n, k, 64)
        assert tuple(linear.weight_int4pack.shape) == (n // 8, k // (tiles * 16), 32, tiles // 2)
        assert linear.weight_int4pack.dtype == torch.int32 and linear.scales_and_zeros.dtype == torch.bfloat16
        assert tuple(linear.scales_and_zeros.shape) == (k // 64, n, 2)
        assert tuple(out.shape) == (5, n) and out.dtype == torch.float32 and out.device.type == "cuda"


@pytest.mark.parametrize("n, k, group_size, problem", [
    (100, 192, 64, "not a multiple of 8"), (96, 200, 8, "group size 8"), (96, 160, 32, None),
    (96, 176, 16, "group size 16"), (96, 192, 128, "group size 128 over 192"), (96, 48, 16, "group size 16")])
def test_shapes_tinygemm_cannot_take_are_refused(n, k, group_size, problem):
    found = cuda_shape_problem(n, k, group_size)
    assert (found is None) if problem is None else (problem in found)
    if problem is not None:
        with FakeTensorMode(), pytest.raises(ValueError, match=problem):
            fake_cuda_linear(n, k, group_size)


def test_an_int4pack_w4_level_may_run_the_static_cuda_runner(checkpoints):
    """The static CUDA runner refuses quantized models but for torch's int4 kernel (one aten call, no host sync)."""
    assert static_unsupported(load_int4pack(checkpoints["sym", "gptq"])) is None
    assert "quantized" in static_unsupported(gptqmodel(checkpoints["sym", "gptq"], "torch_fused"))


def test_the_w4_kernel_setting():
    assert Backend().int4pack("cuda") and not Backend().int4pack("cpu")
    assert Backend(w4_kernel="int4pack").int4pack("cpu") and not Backend(w4_kernel="gptqmodel").int4pack("cuda")
    with pytest.raises(ValueError, match="w4_kernel must be one of auto, gptqmodel, int4pack"):
        Backend(w4_kernel="marlin")


@pytest.mark.parametrize("levels", [
    [{"kind": "model", "model": "target"}, {"kind": "model", "model": "W4", "draft": {"length": 4}}],
    [{"kind": "model", "model": "target"}, {"kind": "model", "model": "W4", "mu": 2, "lm_head": "int8"},
     {"kind": "ngram", "max_ngram": 2, "draft": {"length": 3}}],
], ids=["target <- w4", "target <- w4 (int8 LM head) <- lookup"])
def test_a_greedy_chain_on_the_int4pack_w4_level_is_the_targets(checkpoints, tiny_source, levels, one_thread):
    """decode.w4_kernel=int4pack on a CPU: the W4 level (asymmetric, the harder zero points) runs Int4Linear under
    the HF forward; the output is the target's own greedy decoding."""
    from lossless_fixtures import greedy_equal

    from decode.chains.build import ChainBuilder, LevelSettings

    target = LlamaForCausalLM.from_pretrained(tiny_source).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_source)
    builder = ChainBuilder(target, tokenizer, settings=LevelSettings(backend=Backend("auto", w4_kernel="int4pack")))
    w4 = str(checkpoints["asym", "gptq"])
    chain = builder.build(ChainSpec.parse([{**level, "model": w4} if level.get("model") == "W4" else level
                                           for level in levels]))
    level = chain.levels[1]
    assert any(isinstance(m, Int4Linear) for m in level.model.modules()) and isinstance(level.runner, HFRunner)
    for seed in range(2):
        prompt = torch.randint(3, 300, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
        generation = chain.generate(prompt, 30)
        ok, _ = greedy_equal(target, prompt, generation.tokens)
        assert ok and len(generation.tokens) == 30
        assert generation.stats.levels[0].accepted > 0  # the target took W4's tokens: the level ran


def test_int8_weights_fall_back_on_cuda_in_one_line():
    line = int8_fallback("lm_head: int8", "level 'w4'", "cuda", torch.bfloat16)
    assert line == "decode: level 'w4': lm_head: int8 is a CPU kernel; on cuda it keeps its bfloat16 weights"
    assert int8_fallback("weights: int8", "the draft head", torch.device("cpu"), torch.float32) is None


def test_every_default_chain_builds_on_cuda(capsys):
    """The CUDA build path, asked of the builder's decisions without a GPU: every W4 level of conf/decode/chain.yaml
    loads on torch's int4 kernels (no GPTQModel kernel), every int8 LM head or head weight falls back, said in one
    line, and the model keeps its own LM head."""
    from types import SimpleNamespace

    from decode.chains import build

    chains = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "decode" / "chain.yaml").chains)
    cuda, said = torch.device("cuda"), 0
    for name, levels in chains.items():
        for level in ChainSpec.parse(levels, where=name).levels:
            if level.model == "w4":
                assert Backend().int4pack(cuda), name
            if level.lm_head == "int8":
                model = SimpleNamespace(device=cuda, dtype=torch.bfloat16)
                build._int8_lm_head(level, model, target=SimpleNamespace())
                assert vars(model) == {"device": cuda, "dtype": torch.bfloat16}  # nothing swapped
                said += 1
            if level.weights == "int8":
                assert int8_fallback("weights: int8", "the draft head", cuda, torch.bfloat16) is not None
    lines = capsys.readouterr().err.splitlines()
    assert said and len(lines) == said
    assert all(line.endswith("lm_head: int8 is a CPU kernel; on cuda it keeps its bfloat16 weights") for line in lines)


# the real default's held-out text: at least this share of greedy next tokens as GPTQModel's forward gives them
AGREEMENT = 0.99


@pytest.mark.slow
def test_the_bundled_w4_level_agrees_with_gptqmodel_on_real_text(bundled_w4):
    """The real SmolLM2 W4 checkpoint (tests/conftest.py): the CPU layout (float32 scales and activations) against
    GPTQModel's reference kernel, and CUDA's arithmetic (bf16 scales, zeros and activations, run by the CPU kernel)
    against GPTQModel's CPU int4 kernel, which also computes in bf16."""
    from data.models import load_tokenizer

    tokenizer = load_tokenizer(str(bundled_w4))
    pairs = {"float32": (load_int4pack(bundled_w4), gptqmodel(bundled_w4, "torch")),
             "bf16": (load_int4pack(bundled_w4, kernel_dtype=torch.bfloat16), gptqmodel(bundled_w4, "torch_fused"))}
    for layout, (ours, theirs) in pairs.items():
        same = total = 0
        with torch.no_grad():
            for ids in held_out_text(tokenizer):
                same += (ours(ids).logits.argmax(-1) == theirs(ids).logits.argmax(-1)).sum().item()
                total += ids.shape[1]
        print(f"{layout}: greedy next tokens as GPTQModel's on {same}/{total}")
        assert same / total >= AGREEMENT, layout
