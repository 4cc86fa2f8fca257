"""`python -m decode.interop`: what polyspec publishes, loaded and decoded by real serving engines (vLLM and
llama.cpp, CPU).

The published head and the W4 model are meant to be served by engines that compute them natively, so this
check runs the consumers themselves: vLLM in its own venv (decode/engines/vllm_venv.py; created on first use), one
engine per process (decode/engines/vllm_run.py); llama.cpp's own tools and converter (decode/engines/llamacpp.py).
On the default prompts' first turns, greedy, single stream, same threads:

  (a) vLLM's output with the head as its EAGLE drafter (method eagle or eagle3) equals its output without
      (lossless in vLLM too); for an EAGLE-3 head, llama.cpp's too (`draft-eagle3`, the head converted by
      llama.cpp's convert_hf_to_gguf.py unchanged);
  (b) each engine's mean acceptance length with the head (k drafted tokens) is within a tolerance of polyspec's
      own for the same target, head and a chain draft of k tokens, and above 1 by at least half of polyspec's
      margin (an engine that accepts nothing fails, however little polyspec's head accepts);
  (c) vLLM loads the W4 model, and its teacher-forced greedy agreement with the target's continuations
      matches polyspec's W4 model's, run with the activation dtype vLLM's kernel has (interop.w4_dtype), on the
      same continuations: within a tolerance, or with the positions where only one side matches split so evenly
      that kernel rounding explains them; and where llama.cpp is on, llama.cpp drafts with the W4 level as a
      Q4_0 GGUF losslessly, as many tokens a step as the bundle's serve command (decode.bench.llamacpp.draft_max)
      (llama.cpp's alone where vLLM has no W4 kernel).

It prints those and a tokens/s table: polyspec's AR and dualistic chain next to vLLM's AR, n-gram and head
(and its W4 AR) and llama.cpp's AR, W4 draft and EAGLE-3 head, and writes everything to interop.out. What each
artifact gains in its engine (tokens/s over that engine's AR, acceptance) goes into the checked bundle's chain.json
(serve.measured, each entry saying whether it keeps the target's outputs: vLLM's W4 AR does not) where the
artifact is one of the bundle's levels (a head passed with interop.head to check a
head-less bundle is not: only the bundle's W4 level is recorded then); an artifact that makes its engine slower gets
a line, and its serve entry `recommended: false` with the reason. Exit 0 when every check passed, 4 when one failed.
"""
from __future__ import annotations

import json
import math
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from data.models import cache_dir, resolve_model_path, stores_experts_apart
from decode.engines import InteropError, llamacpp
from decode.publish.bundle import record_measured
from decode.publish.serving import head_method
from decode.settings import InteropChecks, InteropSection, InteropSettings, interop_of
from infra.cli import EXIT_CHECK_FAILED, check_writable, run_main
from infra.device import use_threads
from infra.layout import RunLayout

VLLM_GROUP_SIZES = (-1, 32, 64, 128)  # what vLLM's CPU GPTQ kernel takes (and only if it divides every input width)
ACCEPTANCE_FLOOR = 0.5  # (b): an engine's L must reach 1 + this x (polyspec's L - 1), and exceed 1


# ---------------------------------------------------------------------------------------------- inputs


def bundle_levels(bundle: Path) -> list[dict[str, Any]]:
    """chain.json's levels, each with the folder it was bundled as (None for the target and model-free levels)."""
    manifest = bundle / "chain.json"
    if not manifest.exists():
        return []
    try:
        levels = json.loads(manifest.read_text())["levels"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise InteropError(f"{manifest}: not a chain.json of decode.eval") from None
    return [{**level, "folder": bundle / level["bundled_as"] if level.get("bundled_as") else None} for level in levels]


def head_folder(head: Path | None, levels: list[dict[str, Any]], bundle: Path) -> Path:
    """interop.head (`head`), else the published chain's EAGLE head."""
    found = [level["folder"] for level in levels if level["config"].get("kind") == "eagle" and level["folder"]]
    folder = head or (found[0] if found else None)
    if folder is None:
        raise InteropError(f"no head to check: {bundle} has no published chain with an EAGLE head; "
                           "pass interop.head=<folder>")
    if not (folder / "config.json").exists():
        raise InteropError(f"interop.head={folder}: not a head folder (no config.json)")
    return folder


def w4_folder(w4: Path | None, levels: list[dict[str, Any]], layout: RunLayout) -> Path:
    """interop.w4 (`w4`), else the published chain's quantized level, else the run's quantize.output."""
    found = [level["folder"] for level in levels if level["config"].get("kind", "model") == "model" and level["folder"]]
    folder = w4 or (found[0] if found else layout.output("w4"))
    if not (folder / "config.json").exists():
        raise InteropError(f"no W4 model at {folder}: run python -m quantize.w4 or pass interop.w4=<folder>")
    return folder


def check_w4_layout(folder: Path) -> dict[str, Any]:
    """The checkpoint's quantization_config, refused up front where vLLM would refuse it (one line each)."""
    config = json.loads((folder / "config.json").read_text())
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") != "gptq" or quant.get("bits") != 4 or not quant.get("sym"):
        raise InteropError(f"{folder}: vLLM's CPU GPTQ kernel needs a 4-bit symmetric GPTQ checkpoint; "
                           f"this is {quant.get('quant_method')}, bits {quant.get('bits')}, sym {quant.get('sym')}")
    group = quant.get("group_size")
    if quant.get("desc_act") and group != -1:
        raise InteropError(f"{folder}: desc_act=true with groups (activation order), which vLLM refuses; "
                           "re-quantize with quantize.desc_act=false")
    widths = (config["hidden_size"], config["intermediate_size"])
    if group not in VLLM_GROUP_SIZES or (group != -1 and any(w % group for w in widths)):
        raise InteropError(f"{folder}: group_size {group} is not one vLLM's CPU kernel takes on input widths {widths} "
                           f"({VLLM_GROUP_SIZES}, dividing them)")
    return {k: quant.get(k) for k in ("bits", "group_size", "sym", "desc_act", "act_group_aware")} | {
        "quantized_group_size": (quant.get("meta") or {}).get("polyspec", {}).get("groups", {}).get(
            "quantized_group_size", group)}


def prompts_of(section: InteropSection, tokenizer) -> list[list[int]]:
    from data.prompts import load_questions
    from data.sharegpt import chat_prompt_ids

    questions = load_questions(section.prompts, per_category=section.per_category)
    return [chat_prompt_ids(tokenizer, [{"role": "user", "content": q.turns[0]}]) for q in questions]


# -------------------------------------------------------------------------------------------- polyspec


def polyspec_side(settings: InteropSettings, head: Path, w4: Path | None, prompts: list[list[int]]) -> dict[str, Any]:
    """AR and the dualistic chain (chain draft of k tokens), interleaved per prompt; then polyspec's W4 level's
    teacher-forced agreement with AR's continuations (unless `w4` is None: check (c) is off)."""
    from data.models import load_model
    from decode.chains.baselines import autoregressive
    from decode.chains.build import builder_for, eos_of, load_target
    from quantize.evaluation import teacher_forced_matches

    section, decoding = settings.section, settings.decoding
    target, tokenizer = load_target(decoding)
    eos = eos_of(target.model, tokenizer)
    levels = [{"kind": "model", "name": "target", "model": "target"},
              {"kind": "eagle", "name": "head", "path": str(head.resolve()), "features": "nearest",
               "draft": {"mode": "chain", "length": section.num_speculative_tokens}}]
    chain = builder_for(decoding, target, tokenizer).build(decoding.parse_chain(levels))
    decoders = {"ar": lambda p, n: autoregressive(target, p, n, eos_token_id=eos),
                "chain": lambda p, n: chain.generate(p, n, eos_token_id=eos)}
    runs: dict[str, list] = {name: [] for name in decoders}
    for name, decode in decoders.items():
        decode(prompts[0], section.warmup_tokens)
    for prompt in prompts:
        for name, decode in decoders.items():
            runs[name].append(decode(prompt, section.max_new_tokens))
    result = {name: {"tokens": [g.tokens for g in gens], "seconds": [g.stats.wall_time_s for g in gens]}
              for name, gens in runs.items()}
    rounds = [n for g in runs["chain"] for n in g.stats.levels[0].acceptance_lengths]
    result["chain"]["acceptance_length"] = sum(rounds) / max(len(rounds), 1)
    result["chain"]["levels"] = levels
    if w4 is not None:  # in vLLM's activation dtype: bfloat16 alone moves the agreement by more than kernels do
        w4_model = load_model(str(w4), dtype=section.w4_dtype)[0]
        result["w4_teacher_forced"] = [teacher_forced_matches(w4_model, p, t)
                                       for p, t in zip(prompts, result["ar"]["tokens"])]
        result["w4_dtype"] = section.w4_dtype
    return result


# ------------------------------------------------------------------------------------------------ vLLM


def vllm_jobs(section: InteropSection, target: str, head: Path, w4: Path | None, prompts: list[list[int]],
              ar_tokens: list[list[int]]) -> dict[str, dict]:
    """One job per engine: vLLM's AR, n-gram and head-drafted decoding of the target, and its W4 model (where
    check (c) is on)."""
    k = section.num_speculative_tokens
    llm = {"model": target, "dtype": section.dtype, "max_model_len": section.max_model_len, "enforce_eager": True,
           "seed": 0, "disable_log_stats": False}
    decode = {"prompts": prompts, "max_tokens": section.max_new_tokens, "warmup_tokens": section.warmup_tokens}
    ngram = {"method": "ngram", "num_speculative_tokens": k, **section.ngram}
    jobs = {
        "ar": {"llm": llm, **decode},
        "ngram": {"llm": llm | {"speculative_config": ngram}, **decode},
        "eagle": {"llm": llm | {"speculative_config": {"method": head_method({}, str(head)),
                                                       "model": str(head.resolve()),
                                                       "num_speculative_tokens": k}}, **decode},  # eagle or eagle3
    }
    if w4 is not None:
        jobs["w4"] = {"llm": llm | {"model": str(w4.resolve()), "dtype": section.w4_dtype}, **decode,
                      "teacher_forced": [[p, t] for p, t in zip(prompts, ar_tokens)]}
    return jobs


def run_engine(python: Path, venv: Path, name: str, job: dict, threads: int, log: Path) -> dict[str, Any]:
    """Run one job in the venv (decode/engines/vllm_run.py), vLLM's output appended to `log`. A failure (vLLM refusing
    a checkpoint, a crash) is returned as the job's `error`, not raised: it is what the checks are for.

    One process per engine (a second engine in one process fails in vLLM 0.32's CPU kernel registration), but
    its engine core and worker inside it (VLLM_ENABLE_V1_MULTIPROCESSING=0): one vLLM import per engine, not three."""
    from decode.engines.vllm_venv import RUNNER, engine_env

    script = RUNNER
    env = engine_env(venv, threads) | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    with tempfile.TemporaryDirectory(prefix="polyspec-vllm-") as tmp:
        jobs_file, out_file = Path(tmp) / "jobs.json", Path(tmp) / "results.json"
        jobs_file.write_text(json.dumps({"jobs": [{"name": name, **job}]}))
        print(f"interop: vLLM {name} (log {log}) ...", file=sys.stderr)
        with log.open("a") as fh:
            done = subprocess.run([str(python), str(script), str(jobs_file), str(out_file)], stdout=fh,
                                  stderr=subprocess.STDOUT, env=env, cwd=tmp)
        results = json.loads(out_file.read_text()) if out_file.exists() else {}
    if name in results:
        return results[name]
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    return {"name": name, "error": f"vLLM exited {done.returncode}: {lines[-1] if lines else ''}"[:300]}


# ------------------------------------------------------------------------------------------- llama.cpp


def llamacpp_on(settings: InteropSettings) -> bool:
    """interop.llamacpp (auto | true | false) for the run's target (decode.engines.llamacpp.usable)."""
    model = settings.decoding.model
    return llamacpp.usable(settings.section.llamacpp, model.name, model.dtype, "interop.llamacpp")


def checked_peer(section: InteropSection, target: Path, name: str, speculation: llamacpp.Speculation,
                 prompts: list[str]) -> tuple[llamacpp.LlamaPeer, int]:
    """llama.cpp's AR and `speculation` on decode.interop's prompts (after a warm-up), and on how many of them the
    two outputs are the same."""
    ar = llamacpp.LLAMACPP_AR
    peer = llamacpp.LlamaPeer(llamacpp.ensure_built(), target, section.threads,
                              {ar: llamacpp.Speculation(), name: speculation}, {})
    peer.decode_all(prompts[0], section.warmup_tokens, keep=False)
    for prompt in prompts:
        peer.decode_all(prompt, section.max_new_tokens)
    return peer, sum(llamacpp.same_greedy(a, b, peer.new_tokens) for a, b in zip(peer.runs[ar], peer.runs[name]))


def peer_runs(peer: llamacpp.LlamaPeer) -> dict[str, list[dict[str, Any]]]:
    """Every decode of a checked peer, as interop.out records it."""
    return {name: [vars(o) for o in outs] for name, outs in peer.runs.items()}


def w4_draft_check(settings: InteropSettings, w4_folder: Path, prompts: list[str]) -> dict[str, Any] | None:
    """(c) in llama.cpp (all of it where vLLM cannot run the W4 model): the W4 level as a Q4_0 GGUF drafts for the
    F32 target, k tokens a step as the bundle's serve command has it (`k` in the result;
    decode.bench.llamacpp.draft_max); passed when it loads and every output equals llama.cpp's own AR. None where
    llama.cpp is off (interop.llamacpp)."""
    if not llamacpp_on(settings):
        return None
    target = llamacpp.bundled_target(settings.decoding.model.name)
    try:
        draft = llamacpp.w4_gguf(w4_folder, target)
    except llamacpp.GgufExportError as err:
        return {"passed": False, "detail": f"llama.cpp: {err}"}
    k = settings.llamacpp_draft_max
    peer, same = checked_peer(settings.section, target, "w4", llamacpp.Speculation("draft-simple", draft, k), prompts)
    acceptance = llamacpp.pooled_acceptance(peer.runs["w4"])
    accepted = f"{acceptance:.0%} of drafted tokens accepted" if acceptance is not None else "no token drafted"
    detail = (f"llama.cpp loads {draft.name} as the draft model (k {k}): {same}/{len(prompts)} outputs equal its "
              f"AR, {accepted}")
    return {"passed": same == len(prompts), "detail": detail, "acceptance": acceptance, "identical": same, "k": k,
            "runs": peer_runs(peer)}


def eagle3_head_check(settings: InteropSettings, head: Path, target: Path, prompts: list[str],
                      python: Path) -> dict[str, Any] | None:
    """(a) and (b) in llama.cpp: the EAGLE-3 head folder, converted by llama.cpp's own converter (run by `python`),
    drafts k tokens a step for the F32 target (`draft-eagle3`). Returns the outputs equal to llama.cpp's AR and its
    acceptance length, 1 + k x accepted / drafted (a chain of k drafted every step); None where llama.cpp is off."""
    if not llamacpp_on(settings):
        return None
    section = settings.section
    out = section.out.with_name("head.eagle3.gguf")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        gguf_head = llamacpp.convert_eagle3(head, target, out, python)
    except llamacpp.LlamaCppError as err:
        return {"error": str(err)}
    k = section.num_speculative_tokens
    peer, same = checked_peer(section, llamacpp.bundled_target(settings.decoding.model.name), "eagle3",
                              llamacpp.Speculation("draft-eagle3", gguf_head, k), prompts)
    acceptance = llamacpp.pooled_acceptance(peer.runs["eagle3"])
    return {"gguf": str(gguf_head), "identical": same, "prompts": len(prompts), "acceptance": acceptance,
            "acceptance_length": 1 + k * (acceptance or 0.0), "runs": peer_runs(peer)}


# ---------------------------------------------------------------------------------------------- checks


def tokens_per_s(run: dict[str, Any]) -> float:
    return sum(map(len, run["tokens"])) / max(sum(run["seconds"]), 1e-9)


def vllm_acceptance_length(run: dict[str, Any]) -> float:
    """Tokens per target forward in vLLM's speculative decoding: 1 + accepted drafts per draft round."""
    spec = run.get("spec") or {}
    return 1 + spec.get("num_accepted_tokens", 0) / max(spec.get("num_drafts", 0), 1)


def agreement(matches: list[list[bool]]) -> float:
    flat = [m for row in matches for m in row]
    return sum(flat) / max(len(flat), 1)


def discordance(ours: list[list[bool]], theirs: list[list[bool]]) -> tuple[int, int, float]:
    """The positions where only our model matches the target, where only theirs does, and the two-sided exact
    (McNemar) p-value of so uneven a split if both matched equally often. Two kernels' rounding moves a few
    near-tied positions either way; a checkpoint read wrong loses matches at many positions, all one way."""
    pairs = [(o, t) for row_o, row_t in zip(ours, theirs, strict=True) for o, t in zip(row_o, row_t, strict=True)]
    only_ours, only_theirs = sum(o and not t for o, t in pairs), sum(t and not o for o, t in pairs)
    n = only_ours + only_theirs
    tail = sum(math.comb(n, i) for i in range(min(only_ours, only_theirs) + 1)) / 2**n
    return only_ours, only_theirs, min(1.0, 2 * tail)


def check(name: str, passed: bool | None, detail: str) -> dict[str, Any]:
    return {"name": name, "passed": passed, "detail": detail}


def acceptance_check(wanted: InteropChecks, name: str, engine: str, theirs: float,
                     poly: dict[str, Any]) -> dict[str, Any]:
    """(b): an engine's mean acceptance length with the head vs polyspec's for the same chain draft of k tokens:
    within the tolerance, and above 1 by a real margin (ACCEPTANCE_FLOOR), since a tolerance alone passes an
    engine that accepts nothing (L 1) whenever polyspec's L is within it of 1."""
    ours, tol = poly["chain"]["acceptance_length"], wanted.acceptance_tolerance
    ratio, floor = theirs / ours, 1 + ACCEPTANCE_FLOOR * (ours - 1)
    passed = abs(ratio - 1) <= tol and theirs >= floor and theirs > 1
    return check(name, passed, f"{engine} L {theirs:.3f} vs polyspec L {ours:.3f} (ratio {ratio:.3f}, tolerance "
                               f"{tol:.0%}; must exceed 1 and reach {floor:.3f})")


def vllm_head_checks(wanted: InteropChecks, vllm: dict[str, dict], poly: dict[str, Any]) -> list[dict[str, Any]]:
    """(a) and (b) in vLLM."""
    ar, eagle = vllm["ar"], vllm["eagle"]
    if "error" in ar or "error" in eagle:
        return [check("head_lossless", False, f"vLLM failed: {(ar if 'error' in ar else eagle)['error']}")]
    same = sum(a == b for a, b in zip(ar["tokens"], eagle["tokens"]))
    found = [check("head_lossless", same == len(ar["tokens"]),
                   f"{same}/{len(ar['tokens'])} prompts identical with and without the head")]
    if not wanted.acceptance:
        return found + [check("acceptance", None, "skipped (interop.checks.acceptance=false)")]
    return found + [acceptance_check(wanted, "acceptance", "vLLM", vllm_acceptance_length(eagle), poly)]


def llamacpp_head_checks(wanted: InteropChecks, head: dict[str, Any] | None,
                         poly: dict[str, Any]) -> list[dict[str, Any]]:
    """(a) and (b) in llama.cpp, for an EAGLE-3 head (llama.cpp drafts with no other kind of head)."""
    if head is None:
        return []
    if "error" in head:
        return [check("llamacpp_head_lossless", False, head["error"])]
    found = [check("llamacpp_head_lossless", head["identical"] == head["prompts"],
                   f"llama.cpp drafting with the converted head ({Path(head['gguf']).name}): {head['identical']}/"
                   f"{head['prompts']} outputs equal its AR")]
    if not wanted.acceptance:
        return found + [check("llamacpp_acceptance", None, "skipped (interop.checks.acceptance=false)")]
    return found + [acceptance_check(wanted, "llamacpp_acceptance", "llama.cpp", head["acceptance_length"], poly)]


def vllm_w4_check(wanted: InteropChecks, w4: dict[str, Any], poly: dict[str, Any]) -> tuple[bool, str]:
    """vLLM's W4 model agrees with the target as polyspec's W4 model does (same activation dtype)."""
    if "error" in w4:
        return False, f"vLLM failed on the W4 model: {w4['error']}"
    ours, theirs = agreement(poly["w4_teacher_forced"]), agreement(w4["teacher_forced"])
    only_ours, only_theirs, p = discordance(poly["w4_teacher_forced"], w4["teacher_forced"])
    tol, alpha = wanted.agreement_tolerance, wanted.agreement_alpha
    return (abs(theirs - ours) <= tol or p >= alpha,
            f"teacher-forced greedy agreement with the target: vLLM W4 {theirs:.3f} vs polyspec W4 {ours:.3f} "
            f"({poly['w4_dtype']} activations; tolerance {tol}); positions only polyspec's matches "
            f"{only_ours}, only vLLM's {only_theirs} (exact p {p:.2g}, alpha {alpha})")


def w4_check(wanted: InteropChecks, w4: dict[str, Any] | None, poly: dict[str, Any],
             llama: dict[str, Any] | None) -> dict[str, Any]:
    """(c): vLLM loads the W4 model and agrees as polyspec's W4 model does, and (where llama.cpp is on, `llama`)
    llama.cpp drafts with it losslessly; llama.cpp's alone where vLLM cannot run it."""
    if w4 is None:
        return check("w4_loads", None, "skipped (interop.checks.w4=false)")
    if "not_applicable" in w4 and llama is not None:
        return check("w4_loads", llama["passed"], f"vLLM: not applicable ({w4['not_applicable']}); {llama['detail']}")
    if "not_applicable" in w4:
        return check("w4_loads", None, f"not applicable: {w4['not_applicable']}, and llama.cpp is off")
    passed, detail = vllm_w4_check(wanted, w4, poly)
    if llama is None:
        return check("w4_loads", passed, detail)
    return check("w4_loads", passed and llama["passed"], f"{detail}; {llama['detail']}")


def checks(wanted: InteropChecks, vllm: dict[str, dict], poly: dict[str, Any],
           llama: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """(a) output with the head = without, (b) acceptance length vs polyspec's, in vLLM and (an EAGLE-3 head,
    `llama["head"]`) in llama.cpp; (c) the W4 model loads and agrees (in llama.cpp, `llama["w4"]`, where vLLM
    cannot run it)."""
    llama = llama or {}
    return [*vllm_head_checks(wanted, vllm, poly), *llamacpp_head_checks(wanted, llama.get("head"), poly),
            w4_check(wanted, vllm.get("w4"), poly, llama.get("w4"))]


def table(vllm: dict[str, dict], poly: dict[str, Any], k: int) -> list[dict[str, Any]]:
    """tokens/s per engine and method, with the ratio to the same engine's AR and the acceptance length."""
    rows = [{"engine": "polyspec", "method": "AR", "run": poly["ar"], "reference": poly["ar"]},
            {"engine": "polyspec", "method": f"dualistic, head chain draft k={k}", "run": poly["chain"],
             "reference": poly["ar"], "L": poly["chain"]["acceptance_length"], "artifact": "head"},
            {"engine": "vLLM", "method": "AR", "run": vllm["ar"], "reference": vllm["ar"]},
            {"engine": "vLLM", "method": f"ngram k={k}", "run": vllm["ngram"], "reference": vllm["ar"]},
            {"engine": "vLLM", "method": f"eagle head k={k}", "run": vllm["eagle"], "reference": vllm["ar"],
             "artifact": "head"}]
    if "w4" in vllm:
        rows.append({"engine": "vLLM", "method": "W4 AR", "run": vllm["w4"], "reference": vllm["ar"],
                     "artifact": "w4", "lossless": False})  # the W4 model's own outputs, not the target's
    out = []
    for row in rows:
        run, ref = row.pop("run"), row.pop("reference")
        if "error" in run or "error" in ref or "not_applicable" in run:
            why = run.get("error") or ref.get("error") or f"not applicable: {run['not_applicable']}"
            out.append(row | {"tokens_per_s": None, "x_ar": None, "error": why})
            continue
        tps = tokens_per_s(run)
        row |= {"tokens_per_s": tps, "x_ar": tps / tokens_per_s(ref), "tokens": sum(map(len, run["tokens"])),
                "same_as_ar": sum(a == b for a, b in zip(run["tokens"], ref["tokens"]))}
        if row["engine"] == "vLLM" and "spec" in run and run["spec"]:
            row["L"] = vllm_acceptance_length(run)
        out.append(row)
    return out


def llamacpp_rows(llama: dict[str, Any], k: int) -> list[dict[str, Any]]:
    """llama.cpp's AR and its decoding drafted by the W4 GGUF and by the EAGLE-3 head (from the checks' runs, where
    they ran) as table rows."""

    def speed(outs: list[dict[str, Any]]) -> float:
        return sum(o["new_tokens"] for o in outs) / max(sum(o["prompt_s"] + o["decode_s"] for o in outs), 1e-9)

    base, rows = {"engine": "llama.cpp", "tokens": 0}, []
    for check, name, method, artifact in ((llama.get("w4"), "w4", "draft-simple W4", "w4"),
                                          (llama.get("head"), "eagle3", "draft-eagle3 head", "head")):
        if not check or "runs" not in check:
            continue
        method = f"{method} k={check.get('k', k)}"  # the W4 draft runs at the bundle's serve length
        ar, drafted = check["runs"]["llamacpp_ar"], check["runs"][name]
        if not rows:
            rows.append(base | {"method": "AR (F32 GGUF)", "tokens_per_s": speed(ar), "x_ar": 1.0,
                                "same_as_ar": len(ar)})
        rows.append(base | {"method": method, "tokens_per_s": speed(drafted), "x_ar": speed(drafted) / speed(ar),
                            "same_as_ar": check["identical"], "artifact": artifact}
                    | ({"L": check["acceptance_length"]} if "acceptance_length" in check else {}))
    return rows


def engine_speedups(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per serving engine, each checked artifact's measured effect (`artifact`: head or w4): tokens/s over the same
    engine's AR on the same prompts, the acceptance length where the engine reports one, and whether the method keeps
    the target's outputs (`lossless`: false for serving the W4 model itself) (for chain.json's serve section)."""
    found: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        if row["engine"] == "polyspec" or row.get("x_ar") is None or row.get("artifact") is None:
            continue
        found.setdefault(row["engine"], {})[row["method"]] = {
            "artifact": row["artifact"], "speedup_over_its_ar": row["x_ar"], "tokens_per_s": row["tokens_per_s"],
            "acceptance_length": row.get("L"), "lossless": row.get("lossless", True)}
    return found


def slower_lines(speedups: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """One line per artifact that makes its engine slower than the engine's own plain decoding."""
    return [f"{engine}: {method} makes it slower: {s['speedup_over_its_ar']:.2f}x its own AR"
            for engine, methods in speedups.items() for method, s in methods.items() if s["speedup_over_its_ar"] < 1]


def bundled_artifacts(levels: list[dict[str, Any]], head: Path, w4: Path | None) -> set[str]:
    """Which of the checked artifacts ("head", "w4") are the bundle's own levels (a head or W4 model passed from
    elsewhere is checked, but its speedups say nothing about what the bundle serves)."""
    folders = {level["folder"].resolve() for level in levels if level["folder"]}
    return {name for name, folder in (("head", head), ("w4", w4)) if folder is not None and folder.resolve() in folders}


def record_in_bundle(bundle: Path, speedups: dict[str, dict[str, dict[str, Any]]], interop_out: Path,
                     artifacts: set[str]) -> bool:
    """The speedups of the bundle's own `artifacts` recorded in its chain.json (decode.publish.bundle.record_measured).
    False where the bundle has no chain.json or none of the artifacts is its own."""
    own = {engine: kept for engine, methods in speedups.items()
           if (kept := {m: s for m, s in methods.items() if s["artifact"] in artifacts})}
    return bool(own) and record_measured(bundle, own, f"python -m decode.interop ({interop_out})")


def render(rows: list[dict[str, Any]], found: list[dict[str, Any]], prompts: int) -> str:
    lines = [f"{'engine':<9} {'method':<34} {'tok/s':>7} {'x AR':>6} {'L':>6} {'same as AR':>11}"]
    for r in rows:
        if r.get("error"):
            lines.append(f"{r['engine']:<9} {r['method']:<34} failed: {r['error']}")
            continue
        L = f"{r['L']:.2f}" if "L" in r else "-"
        lines.append(f"{r['engine']:<9} {r['method']:<34} {r['tokens_per_s']:>7.2f} {r['x_ar']:>6.2f} {L:>6} "
                     f"{r['same_as_ar']:>7}/{prompts}")
    mark = {True: "pass", False: "FAIL", None: "skip"}
    lines += [f"check {c['name']}: {mark[c['passed']]}: {c['detail']}" for c in found]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- the app


def inputs(settings: InteropSettings) -> tuple[Path, Path | None, dict[str, Any] | None, str, set[str]]:
    """The head, the W4 model (None with interop.checks.w4=false) and its layout, the target's folder, which of
    head and W4 are the bundle's own levels; checked, with the output's folder, before anything is installed or
    loaded."""
    section = settings.section
    check_writable(section.out, "interop.out", kind="file", error=InteropError)
    levels = bundle_levels(settings.bundle)
    head = head_folder(section.head, levels, settings.bundle)
    w4 = w4_folder(section.w4, levels, settings.decoding.layout) if section.checks.w4 else None
    layout = check_w4_layout(w4) if w4 is not None else None
    model = settings.decoding.model.name
    target = resolve_model_path(model)
    if not Path(target).is_dir():
        raise InteropError(f"model.name={model}: vLLM needs the target as a local folder")
    return head, w4, layout, target, bundled_artifacts(levels, head, w4)


def vllm_side(section: InteropSection, python: Path, venv: Path, jobs: dict[str, dict]) -> dict[str, dict]:
    """Every job in its own vLLM engine; the W4 job is not applicable where vLLM's CPU build has no W4 kernel for it."""
    from decode.engines.vllm_venv import w4_kernel_missing

    log = section.out.with_name("vllm.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    missing = w4_kernel_missing(stores_experts_apart(jobs["w4"]["llm"]["model"])) if "w4" in jobs else None
    vllm = {name: run_engine(python, venv, name, job, section.threads, log) for name, job in jobs.items()
            if name != "w4" or not missing}
    if "w4" in jobs:
        vllm.setdefault("w4", {"name": "w4", "not_applicable": missing})
    return vllm


def llamacpp_side(settings: InteropSettings, paths: tuple[Path, Path | None, str], texts: list[str],
                  python: Path) -> dict[str, Any]:
    """llama.cpp's checks (None each where llama.cpp is off): the W4 level as its draft model (what it gains there
    goes into the bundle on every CPU kind; check (c) rests on it where vLLM cannot run the W4 model), and an
    EAGLE-3 head converted by llama.cpp's converter (run by `python`, the vLLM venv's)."""
    head, w4, target = paths
    found: dict[str, Any] = {"w4": None, "head": None}
    if w4 is not None:
        found["w4"] = w4_draft_check(settings, w4, texts)
    if head_method({}, str(head)) == "eagle3":
        found["head"] = eagle3_head_check(settings, head, Path(target), texts, python)
    return found


def report(settings: InteropSettings, found: list[dict[str, Any]], rows: list[dict[str, Any]],
           record: dict[str, Any]) -> None:
    section = settings.section
    prompts = len(record["polyspec"]["ar"]["tokens"])
    print(f"\n{prompts} prompts, {section.max_new_tokens} new tokens, greedy, single stream, {section.threads} threads "
          f"({platform.processor() or platform.machine()}); vLLM: {section.dtype} target, {section.w4_dtype} W4")
    print(render(rows, found, prompts))
    print(f"vLLM's AR output = polyspec's AR output on {record['vllm_ar_equals_polyspec_ar']}/{prompts} prompts "
          f"({section.dtype} vs {settings.decoding.model.dtype}; informational)")


def run(settings: InteropSettings) -> int:
    from data.models import load_tokenizer
    from decode.engines.vllm_venv import ensure_venv
    from infra.tracking import write_json_atomic

    section = settings.section
    head, w4, layout, target, artifacts = inputs(settings)
    venv = section.venv or cache_dir() / "vllm-venv"
    python = ensure_venv(venv)
    use_threads(section.threads, "interop.threads")
    tokenizer = load_tokenizer(target)
    prompts = prompts_of(section, tokenizer)
    poly = polyspec_side(settings, head, w4, prompts)
    vllm = vllm_side(section, python, venv, vllm_jobs(section, target, head, w4, prompts, poly["ar"]["tokens"]))
    texts = [tokenizer.decode(p, skip_special_tokens=False) for p in prompts]
    llama = llamacpp_side(settings, (head, w4, target), texts, python)
    k = section.num_speculative_tokens
    found, rows = checks(section.checks, vllm, poly, llama), table(vllm, poly, k) + llamacpp_rows(llama, k)
    same = ("failed" if "error" in vllm["ar"]
            else sum(a == b for a, b in zip(vllm["ar"]["tokens"], poly["ar"]["tokens"])))
    record = {"created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "target": target, "head": str(head),
              "w4": str(w4) if w4 else None, "w4_layout": layout, "config": settings.config,
              "checks": found, "table": rows, "vllm_ar_equals_polyspec_ar": same, "polyspec": poly, "vllm": vllm,
              "llamacpp_w4": llama["w4"], "llamacpp_head": llama["head"]}
    report(settings, found, rows, record)
    speedups = engine_speedups(rows)
    for line in slower_lines(speedups):
        print(line)
    write_json_atomic(section.out, record)
    print(f"written {section.out}")
    if record_in_bundle(settings.bundle, speedups, section.out, artifacts):
        print(f"recorded each engine's measured speedup in {settings.bundle / 'chain.json'} (serve.measured)")
    return EXIT_CHECK_FAILED if any(c["passed"] is False for c in found) else 0


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_main(lambda: run(interop_of(cfg)))


if __name__ == "__main__":
    main()
