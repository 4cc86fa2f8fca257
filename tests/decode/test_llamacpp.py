"""llama.cpp as a peer (decode/engines/llamacpp.py, decode/bench.py's peer rows): the tools' arguments and
reports, the build's all-or-nothing marker, the bench peer's switch; the slow tests build llama.cpp (once, cached) and
decode."""
from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from decode.bench import bench_peer
from decode.engines import llamacpp
from decode.engines.llamacpp import LlamaCppError, Speculation, parse_output
from decode.publish import Publication
from decode.publish.serving import serve_commands
from decode.settings import InteropChecks, LlamaCppBench, decoding_of
from infra.layout import RunLayout

PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
REPORT = """main: target: loaded
encoded   12 tokens in    0.050 seconds, speed:  240.000 t/s
decoded   16 tokens in    0.500 seconds, speed:   32.000 t/s

n_draft   = 4
n_predict = 16
n_drafted = 20
n_accept  = 11
accept    = 55.000%
"""


def test_the_report_is_parsed_and_the_echoed_prompt_removed():
    out = parse_output(f"\n\n{PROMPT}Hello there!\n\n\n\n\n", REPORT, PROMPT)
    assert out.text == "Hello there!\n" and out.prompt_tokens == 12 and out.new_tokens == 16
    assert out.prompt_s == 0.05 and out.decode_s == 0.5 and out.tokens_per_s == pytest.approx(16 / 0.55)
    assert (out.drafted, out.accepted, out.acceptance) == (20, 11, 0.55)
    plain = parse_output(f"\n\n{PROMPT}Hi\n\n\n\n", REPORT.split("\nn_draft")[0], PROMPT)
    assert (plain.drafted, plain.accepted, plain.acceptance) == (0, 0, None)


def test_a_missing_report_or_another_prompt_is_one_line():
    with pytest.raises(LlamaCppError, match="no decoding report: error: failed to load model"):
        parse_output("", "loading\nerror: failed to load model\n", PROMPT)
    with pytest.raises(LlamaCppError, match="echoed another prompt"):
        parse_output("\n\n<s>other\n\n", REPORT, PROMPT)


def test_speculation_arguments(tmp_path):
    assert Speculation().args(2)[:2] == ["--spec-type", "ngram-simple"] and "1024" in Speculation().args(2)
    draft = Speculation("draft-simple", draft=tmp_path / "w4.gguf", draft_max=5).args(2)
    assert draft == ["--spec-type", "draft-simple", "-md", str(tmp_path / "w4.gguf"), "-td", "2",
                     "--spec-draft-n-max", "5"]
    ngram = Speculation("ngram-simple", ngram=(("size-m", 6), ("size-n", 3))).args(2)
    assert ngram == ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-m", "6",
                     "--spec-ngram-simple-size-n", "3"]
    with pytest.raises(LlamaCppError, match="needs a draft GGUF"):
        Speculation("draft-simple").args(2)
    with pytest.raises(LlamaCppError, match="unknown llama.cpp speculation 'eagle'"):
        Speculation("eagle").args(2)


def test_serve_commands_name_the_target_and_the_draft():
    commands = serve_commands("/c/target.gguf", "/p/levels/w4.Q4_0.gguf", 4)
    server = shlex.split(commands["llama_server"])
    assert server[:3] == ["llama-server", "-m", "/c/target.gguf"]
    assert server[server.index("-md") + 1] == "/p/levels/w4.Q4_0.gguf" and server[-2:] == ["--spec-draft-n-max", "4"]
    assert shlex.split(commands["llama_speculative_simple"])[0] == "llama-speculative-simple"


def test_a_build_without_its_marker_is_not_ready(tmp_path):
    (tmp_path / "bin").mkdir()
    for tool in llamacpp.TOOLS:
        (tmp_path / "bin" / tool).write_text("")
    assert not llamacpp.is_ready(tmp_path)
    (tmp_path / llamacpp.MARKER).write_text(llamacpp.SDIST + "\n")
    assert llamacpp.is_ready(tmp_path)
    (tmp_path / "bin" / llamacpp.TOOLS[0]).unlink()
    assert not llamacpp.is_ready(tmp_path)


def test_cpu_kind_names_the_widest_vector_isa(monkeypatch):
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    kind = llamacpp.cpu_kind()
    assert kind.split("-")[0] in ("avx512", "avx2", "generic") and len(kind.split("-")[1]) == 8
    assert llamacpp.isa_options({"fpu", "neon"}) == ("-DGGML_NATIVE=ON",)  # not x86: the native build


SAPPHIRE_RAPIDS = {"sse2", "sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx_vnni", *llamacpp.AVX512_BASE,
                   "avx512vbmi", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16"}


def test_an_amx_host_builds_its_isa_by_name_without_amx_in_a_folder_of_its_own(monkeypatch):
    """-march=native would turn ggml's AMX matmul on (SIGILL on Sapphire Rapids): the sets are named, AMX off, and
    the folder's name changes with the options, so the crashing native build is not reused."""
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.setenv("POLYSPEC_CACHE", "/c")
    monkeypatch.setattr(llamacpp, "cpu_flags", lambda: SAPPHIRE_RAPIDS)
    options = llamacpp.isa_options()
    assert options[0] == "-DGGML_NATIVE=OFF" and "-DGGML_NATIVE=ON" not in options
    assert {"-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON", "-DGGML_AVX_VNNI=ON"} <= set(options)
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(options)
    assert not [o for o in options if "AMX" in o and o.endswith("=ON")]
    kind = llamacpp.cpu_kind()
    old = Path("/c/llamacpp") / f"{llamacpp.SDIST.split('==')[1]}-{kind}"  # the key of the native build
    new = llamacpp.default_folder()
    assert kind.startswith("avx512-") and new != old and new.name.startswith(old.name + "-")
    monkeypatch.setattr(llamacpp, "isa_options", lambda: ("-DGGML_NATIVE=ON",))
    assert llamacpp.default_folder() != new  # other options, another folder


def test_forced_avx2_paths_build_an_avx2_only_llamacpp_of_their_own(monkeypatch):
    """ATEN_CPU_CAPABILITY=avx2 on an AVX-512 host: its own build folder, no AVX-512 in it; on an AVX2 host the
    same options as without it."""
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setattr(llamacpp, "cpu_flags", lambda: SAPPHIRE_RAPIDS)
    assert llamacpp.cpu_kind() == "avx2-forced" and "-avx2-forced-" in llamacpp.default_folder().name
    options = llamacpp.isa_options()
    assert {"-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX_VNNI=OFF",
            "-DGGML_AMX_INT8=OFF"} <= set(options)
    zen3 = {"sse2", "sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"}
    monkeypatch.setattr(llamacpp, "cpu_flags", lambda: zen3)
    assert llamacpp.cpu_kind().startswith("avx2-") and llamacpp.cpu_kind() != "avx2-forced"
    forced = llamacpp.isa_options()
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    assert forced == llamacpp.isa_options() and {"-DGGML_AVX2=ON", "-DGGML_AVX512=OFF"} <= set(forced)


def decoding(model="bundled:smollm2-135m-instruct", dtype="float32"):
    from hydra import compose, initialize

    with initialize(version_base="1.3", config_path="../../conf"):
        cfg = compose("config", overrides=[f"model.name={model}", f"model.dtype={dtype}", "run_dir=/nonexistent",
                                           "decode.gemm=onednn"])  # no kernel to build: the peer packs nothing
    return decoding_of(cfg)


def peer_settings(enabled):
    return LlamaCppBench(enabled, 4, {"kind": "ngram-simple", "size-n": 3})


def test_the_peer_is_off_by_switch_or_where_it_cannot_run(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("POLYSPEC_CACHE", str(tmp_path))  # nothing built there
    bundled = decoding()
    assert bench_peer(bundled, peer_settings(False), 2) is None
    assert bench_peer(bundled, None, 2) is None  # no decode.bench.llamacpp section
    assert capsys.readouterr().err == ""
    assert bench_peer(decoding(model="/some/hf/folder"), peer_settings(True), 2) is None
    assert "bundled fp32 target only" in capsys.readouterr().err
    assert bench_peer(bundled, peer_settings("auto"), 2) is None
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "not built" in said[0] and "enabled=true" in said[0]
    with pytest.raises(LlamaCppError, match="must be auto, true or false"):
        bench_peer(bundled, peer_settings("yes"), 2)


def publication(tmp_path, model):
    return Publication(model, "float32", "default", RunLayout(tmp_path / "run"), tmp_path / "p")


def test_a_sweep_is_reported_by_its_fastest_member():
    from decode.bench import best_of_sweeps, peer_table as table

    def row(tps):
        return {"median_tokens_per_s": tps, "median_ratio_vs_polyspec_ar": 1.0, "median_ratio_vs_llamacpp_ar": 1.0,
                "identical_to_llamacpp_ar": 6, "same_text_as_polyspec_ar": 6, "acceptance": 0.5, "runs": 6}

    found = {"llamacpp_ar": row(40.0), "llamacpp_w4 k2": row(35.0), "llamacpp_w4 k4": row(38.0),
             "llamacpp_w4 k8": row(30.0), "llamacpp_ngram": row(41.0)}
    folded = best_of_sweeps(found)
    assert list(folded) == ["llamacpp_ar", "llamacpp_w4", "llamacpp_ngram"]
    assert folded["llamacpp_w4"]["best"] == "llamacpp_w4 k4" and folded["llamacpp_w4"]["median_tokens_per_s"] == 38.0
    assert folded["llamacpp_w4"]["sweep"] == {"llamacpp_w4 k2": 35.0, "llamacpp_w4 k4": 38.0, "llamacpp_w4 k8": 30.0}
    assert "best" not in folded["llamacpp_ar"] and "best" not in folded["llamacpp_ngram"]
    assert "best k4 of k2, k4, k8" in table(folded, {}).splitlines()[2]


def test_the_bundle_serves_llamacpp_only_where_it_can(tmp_path):
    from decode.publish.serving import llamacpp_serve

    where = publication(tmp_path, str(tmp_path / "hf"))
    target = {"config": {"kind": "model", "model": "target"}}
    w4 = {"config": {"kind": "model", "model": "w4"}, "bundled_as": "levels/w4", "source": str(tmp_path / "w4")}
    head = {"config": {"kind": "eagle", "path": "eagle"}, "bundled_as": "levels/head", "source": str(tmp_path / "h")}
    section, gguf = llamacpp_serve(where, [target, head])
    assert gguf is None and section == {"not_served": "llama.cpp: the chain has no quantized model level"}
    section, gguf = llamacpp_serve(where, [target, w4, head])
    assert gguf is None and "is not a bundled GGUF" in section["not_served"]


def test_the_bundle_gives_llamacpp_commands_for_an_eagle3_head(tmp_path, monkeypatch):
    from decode.publish.serving import llamacpp_eagle3_serve

    from data import models

    monkeypatch.setattr(llamacpp, "target_gguf", lambda name: tmp_path / f"{name}-F32.gguf")
    monkeypatch.setattr(models, "resolve_model_path", lambda name: str(tmp_path / "hf"))
    where = publication(tmp_path, "bundled:smollm2-135m-instruct")
    target = {"config": {"kind": "model", "model": "target"}}
    head3 = {"config": {"kind": "eagle", "path": "eagle", "method": "eagle3", "draft": {"mode": "chain", "length": 3}},
             "bundled_as": "levels/head", "source": str(tmp_path / "h")}
    found = llamacpp_eagle3_serve(where, [target, head3])
    convert, server = shlex.split(found["convert"]), shlex.split(found["llama_server"])
    bundled = str(tmp_path / "p" / "levels" / "head")
    assert convert[1:3] == ["convert_hf_to_gguf.py", bundled] and "--target-model-dir" in convert
    assert server[server.index("--spec-type") + 1] == "draft-eagle3"
    assert server[server.index("-md") + 1] == convert[convert.index("--outfile") + 1] == bundled + ".eagle3.gguf"
    assert server[server.index("--spec-draft-n-max") + 1] == "3"
    head2 = {**head3, "config": {**head3["config"], "method": "eagle"}}
    assert llamacpp_eagle3_serve(where, [target, head2]) is None  # llama.cpp has no EAGLE-1/2 drafter
    other = publication(tmp_path, str(tmp_path / "hf"))
    assert "not a bundled GGUF" in llamacpp_eagle3_serve(other, [target, head3])["not_served"]


def test_a_bundle_entry_may_be_a_file(tmp_path):
    from decode.publish.bundle import publish_bundle

    (tmp_path / "report").mkdir()
    (tmp_path / "w4.gguf").write_bytes(b"GGUF")
    bundle = publish_bundle(tmp_path / "publish", {"chain": "polybasic"}, tmp_path / "report",
                            {"w4.Q4_0.gguf": tmp_path / "w4.gguf"})
    assert (bundle / "levels" / "w4.Q4_0.gguf").read_bytes() == b"GGUF"


def test_interop_check_c_is_made_in_llamacpp_where_vllm_cannot_run_w4():
    from decode.interop import checks

    wanted = InteropChecks(acceptance=False, agreement_tolerance=0.05)
    runs = {"tokens": [[1, 2]]}
    missing = "vLLM's CPU W4A16 kernel needs AVX-512 and this CPU has AVX2 only"
    vllm = {"ar": runs, "eagle": runs, "w4": {"not_applicable": missing}}
    llama = {"passed": True,
             "detail": "llama.cpp loads w4.Q4_0.gguf as the draft model (k 3): 1/1 outputs equal its AR"}
    (w4,) = [c for c in checks(wanted, vllm, {}, {"w4": llama}) if c["name"] == "w4_loads"]
    assert w4["passed"] is True and "AVX2 only" in w4["detail"] and "1/1 outputs equal its AR" in w4["detail"]
    (w4,) = [c for c in checks(wanted, vllm, {}, {"w4": llama | {"passed": False}}) if c["name"] == "w4_loads"]
    assert w4["passed"] is False
    (w4,) = [c for c in checks(wanted, vllm, {}) if c["name"] == "w4_loads"]
    assert w4["passed"] is None and "llama.cpp is off" in w4["detail"]
    failed = vllm | {"w4": {"error": "AttributeError: '_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16'"}}
    (w4,) = [c for c in checks(wanted, failed, {}, {"w4": llama}) if c["name"] == "w4_loads"]
    assert w4["passed"] is False  # vLLM failing where it should run is a failure, whatever llama.cpp says
    # where vLLM runs the W4 model and llama.cpp is on, (c) needs both
    matches = [[True, False, True, True]]
    ran = vllm | {"w4": {"teacher_forced": matches}}
    poly = {"w4_teacher_forced": matches, "w4_dtype": "bfloat16"}
    (w4,) = [c for c in checks(wanted, ran, poly, {"w4": llama}) if c["name"] == "w4_loads"]
    assert w4["passed"] is True and "vLLM W4 0.750 vs polyspec W4 0.750" in w4["detail"], w4
    assert w4["detail"].endswith("1/1 outputs equal its AR")
    (w4,) = [c for c in checks(wanted, ran, poly, {"w4": llama | {"passed": False}}) if c["name"] == "w4_loads"]
    assert w4["passed"] is False  # llama.cpp's draft not lossless: a failure though vLLM agrees
    (w4,) = [c for c in checks(wanted, ran, poly) if c["name"] == "w4_loads"]
    assert w4["passed"] is True and "llama.cpp" not in w4["detail"]


def test_interop_checks_an_eagle3_head_in_llamacpp_as_in_vllm():
    from decode.interop import checks, llamacpp_rows

    wanted = InteropChecks(acceptance=True, acceptance_tolerance=0.10, w4=False)
    runs = {"tokens": [[1, 2]], "spec": {"num_drafts": 10, "num_accepted_tokens": 4}}
    vllm, poly = {"ar": runs, "eagle": runs}, {"chain": {"acceptance_length": 1.4}}
    out = {"new_tokens": 8, "prompt_s": 0.1, "decode_s": 0.3}
    head = {"gguf": "/r/head.eagle3.gguf", "identical": 2, "prompts": 2, "acceptance_length": 1.45,
            "runs": {"llamacpp_ar": [out, out], "eagle3": [out | {"decode_s": 0.1}] * 2}}
    found = {c["name"]: c for c in checks(wanted, vllm, poly, {"head": head})}
    assert found["head_lossless"]["passed"] and found["acceptance"]["passed"]  # vLLM: L 1.4 = polyspec's
    assert found["llamacpp_head_lossless"]["passed"] and "2/2 outputs equal its AR" in found["llamacpp_head_lossless"][
        "detail"]
    assert found["llamacpp_acceptance"]["passed"] and "llama.cpp L 1.450" in found["llamacpp_acceptance"]["detail"]
    assert found["w4_loads"]["passed"] is None  # interop.checks.w4=false
    worse_head = head | {"identical": 1, "acceptance_length": 1.0}
    worse = {c["name"]: c for c in checks(wanted, vllm, poly, {"head": worse_head})}
    assert worse["llamacpp_head_lossless"]["passed"] is False and worse["llamacpp_acceptance"]["passed"] is False
    failed = {c["name"]: c for c in checks(wanted, vllm, poly, {"head": {"error": "convert_hf_to_gguf.py failed"}})}
    assert failed["llamacpp_head_lossless"]["passed"] is False and "llamacpp_acceptance" not in failed
    ar_row, head_row = llamacpp_rows({"head": head, "w4": None}, 3)
    assert ar_row["tokens_per_s"] == 20.0 and head_row["x_ar"] == 2.0 and head_row["L"] == 1.45


def test_speculation_drafts_with_an_eagle3_gguf():
    args = Speculation("draft-eagle3", Path("h.gguf"), 3).args(2)
    assert args == ["--spec-type", "draft-eagle3", "-md", "h.gguf", "-td", "2", "--spec-draft-n-max", "3"]
    with pytest.raises(LlamaCppError, match="draft-eagle3 needs a draft GGUF"):
        Speculation("draft-eagle3").args(2)


def test_greedy_outputs_agree_up_to_a_drafting_runs_overshoot():
    from decode.engines.llamacpp import LlamaOutput, same_greedy

    def out(text, n):
        return LlamaOutput(text, n, 10, 0.1, 1.0)

    assert same_greedy(out("a b c", 3), out("a b c", 3), 3)
    assert same_greedy(out("a b c", 3), out("a b c d e", 5), 3)  # the drafting run overshot the limit of 3
    assert not same_greedy(out("a b c", 3), out("a b x d", 4), 3)
    assert not same_greedy(out("a b", 2), out("a b c", 3), 3)  # the shorter one stopped early: no prefix excuse


def rtn_checkpoint(folder, hf_folder, group: int = 64) -> None:
    """A symmetric 4-bit GPTQ-format checkpoint of a Llama folder by rounding to nearest (no calibration): the
    layout quantize.w4 writes, made in seconds."""
    import json

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from test_llamacpp_gguf import pack_codes

    parts = {}
    with safe_open(str(hf_folder / "model.safetensors"), "pt") as hf:
        for key in (k for k in hf.keys() if k.endswith("_proj.weight")):
            weight = hf.get_tensor(key).float()  # [out, in]
            blocks = weight.view(weight.shape[0], -1, group)
            scales = (blocks.abs().amax(-1) / 7).clamp(min=1e-8).half()  # [out, groups]
            codes = (blocks / scales.float().unsqueeze(-1)).round().clamp(-8, 7) + 8
            prefix = key.removesuffix(".weight")
            parts |= {f"{prefix}.qweight": pack_codes(codes.view(weight.shape).t().long()),
                      f"{prefix}.qzeros": pack_codes(torch.full(scales.shape, 7)).t().contiguous(),
                      f"{prefix}.scales": scales.t().contiguous(),
                      f"{prefix}.g_idx": (torch.arange(weight.shape[1]) // group).to(torch.int32)}
    folder.mkdir()
    save_file(parts, folder / "model.safetensors")
    quant = {"quant_method": "gptq", "bits": 4, "sym": True, "desc_act": False, "group_size": group,
             "checkpoint_format": "gptq"}
    (folder / "config.json").write_text(json.dumps({"quantization_config": quant}))


@pytest.mark.slow
def test_llamacpp_builds_and_decodes_losslessly_with_the_w4_gguf_as_draft(tmp_path):
    """Builds llama.cpp once (cached; tens of minutes the first time on two busy cores), then on a real chat prompt:
    plain decoding, the W4 level (a rounded-to-nearest stand-in, exported exactly) as draft model, and the n-gram
    mode all give the same greedy text; llama.cpp reads the prompt as the same tokens polyspec does."""
    from data.models import convert_bundled, load_tokenizer
    from data.sharegpt import chat_prompt_ids
    from decode.engines.llamacpp import decode, ensure_built, same_greedy, target_gguf, tokenize, w4_gguf

    tools = ensure_built()
    hf_folder = convert_bundled("smollm2-135m-instruct")
    target = target_gguf()
    rtn_checkpoint(tmp_path / "w4", hf_folder)
    draft = w4_gguf(tmp_path / "w4", target)
    tokenizer = load_tokenizer(str(hf_folder))
    ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": "Write a short poem about the sea."}])
    prompt, n = tokenizer.decode(ids, skip_special_tokens=False), 32
    plain = decode(tools, target, prompt, n, 1)
    assert tokenize(tools, target, prompt) == ids
    assert plain.prompt_tokens == len(ids) and plain.new_tokens == n and plain.drafted == 0 and plain.text
    for speculation in (Speculation("draft-simple", draft=draft, draft_max=4),
                        Speculation("ngram-simple", ngram=(("size-n", 3), ("size-m", 6)))):
        out = decode(tools, target, prompt, n, 1, speculation)
        assert same_greedy(out, plain, n), (speculation.kind, out.text, plain.text)
    assert out.prompt_tokens == plain.prompt_tokens
    drafted = decode(tools, target, prompt, n, 1, Speculation("draft-simple", draft=draft, draft_max=4))
    assert drafted.drafted > 0 and drafted.accepted > 0


@pytest.mark.slow
def test_the_projects_build_decodes_a_quantized_gguf():
    """The bundled Q4_1 file (Q8_0 embeddings) decoded by the project's build: the quantized matmuls that died with
    SIGILL in ggml's AMX path on Sapphire Rapids under the native build."""
    from data.models import bundled_gguf
    from decode.engines.llamacpp import decode, ensure_built

    prompt = "<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n<|im_start|>assistant\n"
    out = decode(ensure_built(), bundled_gguf("smollm2-135m-instruct"), prompt, 16, 2)
    assert out.new_tokens == 16 and out.text.strip() and out.drafted == 0


@pytest.mark.slow
def test_the_target_quantized_by_llama_quantize_decodes(tmp_path):
    """decode.bench's lossy Q8_0 row: llama-quantize makes the file once (beside the F32 one) and it decodes."""
    import shutil

    from decode.engines.llamacpp import decode, ensure_built, quantized, target_gguf

    tools, f32 = ensure_built(), tmp_path / "smollm2-F32.gguf"
    shutil.copy(target_gguf(), f32)
    q8 = quantized(tools, f32, "Q8_0")
    assert q8 == tmp_path / "smollm2-Q8_0.gguf" and q8.stat().st_size < f32.stat().st_size / 3
    assert quantized(tools, f32, "Q8_0") == q8 and not list(tmp_path.glob(".*tmp*"))  # made once, no leftovers
    prompt = "<|im_start|>user\nName two colours.<|im_end|>\n<|im_start|>assistant\n"
    assert decode(tools, q8, prompt, 8, 2).new_tokens == 8


@pytest.mark.slow
def test_the_bench_peer_runs_every_engine_of_its_sweep():
    """decode.bench's llama.cpp rows: the F32 AR, the lossy Q8_0 and Q4_1 files alone, and the W4 draft (the bundled
    Q4_1 file standing in: no W4 checkpoint here) and n-gram modes at each draft length of the sweep."""
    from decode.settings import LlamaCppBench

    peer = bench_peer(decoding(), LlamaCppBench(True, 4, {"kind": "ngram-simple", "size-n": 3, "size-m": 6}, (2, 4)), 1)
    assert set(peer.engines) == {"llamacpp_ar", "llamacpp_q8_0", "llamacpp_q4_1", "llamacpp_w4 k2", "llamacpp_w4 k4",
                                 "llamacpp_ngram k2", "llamacpp_ngram k4"}
    assert peer.engines["llamacpp_ngram k4"].ngram == (("size-m", 4), ("size-n", 3))
    assert peer.models["llamacpp_q8_0"].name.endswith("-Q8_0.gguf") and "stand-in" in peer.notes["llamacpp_w4"]
    peer.decode_all("<|im_start|>user\nName two colours.<|im_end|>\n<|im_start|>assistant\n", 6)
    assert all(len(runs) == 1 and runs[0].new_tokens > 0 for runs in peer.runs.values()) and len(peer.runs) == 7
