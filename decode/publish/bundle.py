"""Publishing: the gate that picks the chain (only one shown faster than AR, every check passed), its chain.json
(with the serve commands of decode.publish.serving, and later what each engine measured with them), and the bundle
written all or nothing; stale temp folders cleaned, a refused bundle set aside."""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
import shutil
import time
from pathlib import Path
from typing import Any

from decode.evaluation import speedup as paired
from decode.publish import Publication
from decode.publish.serving import LLAMACPP_W4, llamacpp_eagle3_serve, llamacpp_serve, serve_of
from infra.layout import RunLayout
from infra.tracking import atomic_dir, write_json_atomic

SERVE_ENTRIES = {("llama.cpp", "draft-simple W4"): "llamacpp", ("llama.cpp", "draft-eagle3"): "llamacpp_eagle3",
                 ("vLLM", "eagle head"): None}  # (engine, method) -> its key in chain.json's serve (None: serve itself)


def folder_hash(path: str | Path) -> str:
    """Content hash of a folder: relative paths and bytes of every file, in sorted order (16 hex chars)."""
    h, root = hashlib.sha256(), Path(path)
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(root)).encode() + b"\0")
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


def library_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for dist in ("polyspec", "torch", "transformers", "gptqmodel", "optimum", "safetensors", "deepspeed", "hydra-core",
                 "wandb"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = "not installed"
    return versions


def publish_bundle(
    publish_dir: str | Path, chain_json: dict[str, Any], report_dir: str | Path, folders: dict[str, str | Path],
) -> Path:
    """Write the bundle in a temp folder next to publish_dir and rename it into place (all or nothing).

    `folders` maps a level name to the folder to copy (the head, the W4 model): bundle/levels/<name>/.
    """
    final = Path(publish_dir)
    with atomic_dir(final) as tmp:
        shutil.copytree(report_dir, tmp / "report")
        for name, folder in folders.items():  # a level's folder, or a file (the W4 GGUF for llama.cpp)
            if Path(folder).is_file():
                (tmp / "levels").mkdir(exist_ok=True)
                shutil.copy2(folder, tmp / "levels" / name)
            else:
                shutil.copytree(folder, tmp / "levels" / name)
        (tmp / "chain.json").write_text(json.dumps(chain_json, indent=2, sort_keys=True, default=str) + "\n")
    return final


def record_measured(bundle: Path, speedups: dict[str, dict[str, dict[str, Any]]], by: str) -> bool:
    """The bundle's chain.json gains serve.measured: each engine's measured speedups (`by`: what measured them), and
    an entry whose artifact made its engine slower is marked (mark_slower); rewritten through a temporary file.
    False where the bundle has no chain.json."""
    manifest = bundle / "chain.json"
    if not manifest.exists():
        return False
    data = json.loads(manifest.read_text())
    serve = data.setdefault("serve", {})
    serve["measured"] = {"engines": speedups, "by": by,
                         "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    mark_slower(serve, speedups)
    write_json_atomic(manifest, data)
    return True


def mark_slower(serve: dict[str, Any], speedups: dict[str, dict[str, dict[str, Any]]]) -> None:
    """Each serve entry whose artifact made its engine slower than the engine's own plain decoding gets
    `recommended: false` and the one-line reason."""
    for engine, methods in speedups.items():
        for method, measured in methods.items():
            entry, speedup = _serve_entry(serve, engine, method), measured["speedup_over_its_ar"]
            if entry is not None and speedup < 1:
                entry["recommended"] = False
                entry["why"] = (f"{method} measured {speedup:.2f}x {engine}'s own plain decoding (decode.interop): "
                                "serve the target without it")


def _serve_entry(serve: dict[str, Any], engine: str, method: str) -> dict[str, Any] | None:
    """The entry of chain.json's serve section that serves a measured artifact (None where none does)."""
    for (name, prefix), key in SERVE_ENTRIES.items():
        if name == engine and method.startswith(prefix):
            entry = serve if key is None else serve.get(key)
            return entry if isinstance(entry, dict) else None
    return None


def failed_lines(checks: list[dict[str, Any]]) -> list[str]:
    return [f"check failed: {c['name']}: {reason}" for c in checks if not c["passed"] for reason in c["reasons"]]


def level_folder(level: dict[str, Any], artifacts: RunLayout) -> Path | None:
    """The folder a level loads from (head, W4 model), resolved as decode.chains.build does; None for the target,
    `untrained` and models that are no folder (bundled:, hub ids)."""
    kind = level.get("kind", "model")
    source = level.get("path") if kind == "eagle" else level.get("model") if kind == "model" else None
    if not source or source in ("target", "untrained"):
        return None
    path = Path(artifacts.model_spec(str(source))) if kind == "model" else artifacts.folder(str(source))
    return path if path.is_dir() else None


def chain_manifest(
    where: Publication, name: str, chain: list[dict[str, Any]], target_hash: str, report: dict[str, Any],
    decision: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, Path]]:
    """chain.json for the published chain (its levels as decoded, planned values included), and the level
    folders to copy into the bundle."""
    levels, folders = [], {}
    for i, level in enumerate(chain):
        entry, label = {"config": level}, level.get("name") or f"L{i + 1}"
        folder = level_folder(level, where.layout)
        if folder is not None:
            entry |= {"source": str(folder), "content_hash": folder_hash(folder), "bundled_as": f"levels/{label}"}
            folders[label] = folder
        elif level.get("model") == "target":
            entry |= {"source": where.model, "dtype": where.dtype, "content_hash": target_hash}
        elif level.get("kind", "model") != "ngram":
            entry["source"] = str(level.get("model") or level.get("path"))  # a hub id, or `untrained`
        levels.append(entry)
    summary, result = report["summaries"][name], report["chains"][name]
    plan = next(({"base": base, "published": "stack" if p.get("stack") else "planned" if name != base else "configured",
                  **p}
                 for base, p in report["plans"].items() if name in (base, p["chain"])), None)
    manifest = {
        "chain": name, "run_name": where.run_name, "levels": levels, "plan": plan,
        "measured": {
            "speedup_over_ar": result["time_speedup"], "speedup_over_ar_interval": result["time_speedup_interval"],
            "spec_bench_speedup": result["measured_speedup"],
            "decode_time_s": result["decode_time_s"],
            "predicted_decode_time_s": {k: p.get("time_s") for k, p in result["predictions"].items()},
            "T_s": [level["T_s"] for level in summary["levels"]],
            "L": [level["L_mean"] for level in summary["levels"][:-1]],
            "draft_depth": summary["draft_depth"],
        },
        "checks": {c["name"]: name not in c["by_chain"] for c in report["checks"]}
                  | {"faster_than_ar": paired.Interval.from_dict(decision.get("corrected_intervals", {}).get(
                      name, result["time_speedup_interval"])).above_one},  # as the gate judged it (Holm)
        "forced": decision["forced"], "rejected": decision["rejected"], "failed_checks": decision["failures"],
        "versions": library_versions(), "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "serve": serve_of(where, levels),
    }
    manifest["serve"]["llamacpp"], w4_gguf = llamacpp_serve(where, levels)
    if (eagle3 := llamacpp_eagle3_serve(where, levels)) is not None:
        manifest["serve"]["llamacpp_eagle3"] = eagle3
    if w4_gguf is not None:
        folders[LLAMACPP_W4] = w4_gguf
    return manifest, folders


def gate(checks: list[dict[str, Any]], speedups: dict[str, paired.Interval], choice: str = "best",
         force: bool = False) -> dict[str, Any]:
    """Which chain to publish, if any. `speedups`: each chain's time speedup over AR with its interval.

    A chain is admissible when no check failed for it (lossless, insertion of its levels, agreement) and
    it is shown faster than AR: its interval's lower bound is above 1. choice=best publishes the admissible
    chain with the highest lower bound; choice=<chain> is the strict gate: that chain, only if it is shown
    faster than AR and every check of every chain passed. force=true overrides failed checks, never the
    speed: a chain not shown faster than AR is never published. Under choice=best every chain is a candidate, so
    "shown faster" is Holm-corrected over them all (`paired.holm`): the chance of publishing a chain that is not
    faster stays at one interval's one-sided level however many chains are compared."""
    m = len(speedups)
    correction = (f"Holm over the {m} chains considered: each speedup's interval redrawn at its step's level, "
                  "so a chain not faster than AR is shown faster with at most one interval's one-sided error rate"
                  if choice == "best" and m > 1 else "none: one chain considered")
    speedups = paired.holm(speedups) if choice == "best" else speedups
    failures, strict_ok = failed_lines(checks), not failed_lines(checks)
    rejected = {n: [f"{c['name']}: {r}" for c in checks for r in c["by_chain"].get(n, [])] for n in speedups}
    for n, x in speedups.items():
        if not x.above_one:
            rejected[n].append(f"faster than AR: {x.verdict()}")
            failures.append(f"check failed: faster than AR: {n} measured {x.verdict()} at {x.confidence:.0%} "
                            "confidence (a chain not shown faster than AR is never published)")
    fast = [n for n, x in speedups.items() if x.above_one]
    if choice == "best":
        admissible = [n for n in fast if not rejected[n]]
        pool = admissible or (fast if force else [])
    else:
        admissible = [choice] if choice in fast and strict_ok else []
        pool = [choice] if choice in fast and (strict_ok or force) else []
    chain = max(pool, key=lambda n: speedups[n].low, default=None)
    forced = chain is not None and chain not in admissible
    if chain is None:
        decision, explanation = "not published", _refusal(speedups, fast, choice)
    elif forced:
        decision = "published (forced)"
        explanation = (f"{chain} ({speedups[chain].text()} AR): publish.force=true overrode: "
                       + " | ".join(rejected[chain] or failures))
    else:
        decision = "published"
        explanation = (f"{chain}, the fastest admissible chain by its interval's lower bound: "
                       f"{speedups[chain].verdict()} than AR at {speedups[chain].confidence:.0%} confidence."
                       if choice == "best"
                       else f"{chain}: every check passed and it measured {speedups[chain].verdict()} than AR.")
    return {"publish": chain is not None, "chain": chain, "choice": choice, "forced": forced, "admissible": admissible,
            "rejected": {n: r for n, r in rejected.items() if r}, "failures": failures, "decision": decision,
            "explanation": explanation, "correction": correction,
            "corrected_intervals": {n: x.as_dict() for n, x in speedups.items()}}


def _refusal(speedups: dict[str, paired.Interval], fast: list[str], choice: str) -> str:
    """Why nothing is published; first of all when no chain is shown faster than AR, with every interval."""
    if not fast:
        levels = ", ".join(sorted({f"{x.confidence:.0%}" for x in speedups.values()}))
        shown = "; ".join(f"{n} {x.verdict()}" for n, x in speedups.items())
        return f"no chain is shown faster than AR: {shown} ({levels} intervals)."
    if choice == "best":
        return "no chain is admissible."
    return f"eval.publish.chain={choice} (strict): " + (
        f"it is not shown faster than AR ({speedups[choice].verdict()})." if choice not in fast else
        "a check failed; the strict gate needs every check to pass.")


def clean_stale(outputs: list[str | Path]) -> list[Path]:
    """Remove the temp folders an interrupted eval left next to its outputs (.eval.tmp-*, .publish.old-*)."""
    removed = []
    for out in map(Path, outputs):
        for pattern in (f".{out.name}.tmp-*", f".{out.name}.old-*"):
            for stale in out.parent.glob(pattern):
                shutil.rmtree(stale, ignore_errors=True)
                removed.append(stale)
    return removed


def set_aside(publish_dir: str | Path) -> Path | None:
    """After a refused publish the previous bundle must not look current: move it to <dir>.stale."""
    final = Path(publish_dir)
    if not final.exists():
        return None
    stale = final.with_name(f"{final.name}.stale")
    shutil.rmtree(stale, ignore_errors=True)
    final.rename(stale)
    return stale
