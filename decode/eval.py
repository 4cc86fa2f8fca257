"""`python -m decode.eval`: measure the chains side by side, check them against Theorems 3.1-3.2, publish.

Every question (multi-turn ones with the reference answers as context, so every method sees the same
prompt) is decoded greedily by the autoregressive target and by every configured chain, interleaved,
after a warm-up. Three named checks and the speed decide which chain is published:
  lossless   every chain's output equals the AR output token for token (a divergence is excused only
             at a numerical near-tie of the target's top-2 logits, docs/design.md "What 'lossless' means");
  insertion  every level inserted between two others (a chain equal to another plus one middle level)
             lowers the time by Theorem 3.2 on the measured T and L;
  agreement  the refined prediction of each chain's decoding time (decode.evaluation.measure; Theorem 3.1 with each
             level's rounds counted from what it hands up) is within a tolerance of the measured time,
             and an insertion the theory admits is measured faster. Theorem 3.1's own error is reported.
Before decoding, decode.chains.plan calibrates each chain on held-out prompts and picks mu and the draft
length or tree size; a plan that changes them is decoded too, as `<chain>_planned`. A chain is
admissible when no check failed for it and it is shown faster than AR: the lower bound of its speedup's
interval (decode.evaluation.speedup, paired over turns, level eval.confidence) is above 1. The admissible chain with
the highest lower bound is published (eval.publish.chain=<chain>: that chain only, and only if every check
passed). The agreement check likewise fails only on what the intervals show.
T_i is the engine's mean forward time; L_i and its variance pool every verification of the run, and
Theorem 3.3 compares that variance with a sampled decode (temperature 1) per level.
Exit codes (infra/cli.py, README): 0 published, 2 bad input (a one-line error), 3 no chain admissible and nothing
published.
"""
from __future__ import annotations

import sys
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from decode.evaluation import EvalError
from decode.evaluation import speedup as paired
from decode.evaluation.checks import ReferenceFn, evaluate
from decode.evaluation.publish import chain_manifest, clean_stale, gate, publish_bundle, set_aside
from decode.evaluation.runner import Decoded, build_decoders, decode_questions, decode_sampled, plan_chains
from infra.cli import EXIT_NOT_PUBLISHED, run_main
from infra.device import use_threads
from infra.settings import tracking_of


def checked_confidence(value: Any) -> float:
    """eval.confidence, or the one-line EvalError."""
    try:
        return paired.checked_confidence(value)
    except paired.IntervalError as err:
        raise EvalError(f"eval.{err}") from None


def run(cfg: DictConfig) -> int:
    from data.models import weights_hash
    from data.prompts import load_questions
    from decode.chains.build import configured_builder, eos_of, load_target
    from infra.cli import check_writable, flag
    from infra.tracking import Tracker

    ecfg = cfg.eval
    for key, least in (("max_new_tokens", 1), ("warmup_tokens", 0)):
        value = ecfg.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise EvalError(f"eval.{key} must be >= {least} (an integer), got {value!r}")
    per_category = ecfg.get("per_category")
    if per_category is not None and (isinstance(per_category, bool) or not isinstance(per_category, int)
                                     or per_category < 1):
        raise EvalError(f"eval.per_category must be null or an integer >= 1, got {per_category!r}")
    flag(ecfg.publish, "force", error=EvalError)  # a string such as 'false' would be truthy
    checked_confidence(ecfg.get("confidence"))
    flag(cfg.decode, "fast", default=False, error=EvalError)
    check_writable(ecfg.out_dir, "eval.out_dir", error=EvalError)  # fail now, not after the decoding
    check_writable(ecfg.publish.dir, "eval.publish.dir", error=EvalError)
    if ecfg.publish.chain != "best" and ecfg.chains.get(ecfg.publish.chain) is None:
        raise EvalError(f"eval.publish.chain={ecfg.publish.chain!r} is not one of eval.chains "
                        f"({', '.join(ecfg.chains)}) nor 'best'")
    questions = load_questions(ecfg.prompts, ecfg.per_category)
    use_threads(cfg.decode.get("threads"), "decode.threads")
    prepared, tokenizer = load_target(cfg)
    target = prepared.model
    builder, eos = configured_builder(cfg, prepared, tokenizer), eos_of(target, tokenizer)
    decoders, specs = build_decoders(cfg, builder, eos)
    tracker = Tracker(tracking_of(cfg), "eval")
    for art in ecfg.publish.lineage:  # this run consumed the head and the W4 model those stages logged
        tracker.use_artifact(art.name, art.type)
    plans = plan_chains(cfg, builder, specs, decoders, questions, eos) if ecfg.plan.enabled else {}
    records = decode_questions(decoders, questions, tokenizer, ecfg.max_new_tokens, ecfg.warmup_tokens)
    t33 = ecfg.theorem_3_3
    sampled = decode_sampled({n: decoders[n] for n in specs}, questions[: int(t33.questions)], tokenizer,
                             ecfg.max_new_tokens, float(t33.temperature), int(t33.seed)) if t33.questions else {}
    chains = ({name: spec.as_config() for name, spec in specs.items()}
              | {p["chain"]: p["levels"] for p in plans.values()})
    decoded = Decoded(records, chains, len(questions), plans, sampled)
    from decode.chains.baselines import greedy_margins

    def reference_fn(prompt: list[int], forced: list[int], n: int):
        return greedy_margins(prepared, prompt, forced, n, eos)

    return conclude(cfg, decoded, reference_fn, weights_hash(target), tracker)


def conclude(cfg: DictConfig, decoded: Decoded, reference_fn: ReferenceFn,
             target_hash: str, tracker: Any) -> int:
    """From decoded records to the gate: evaluate, write the report, publish or refuse; the exit code."""
    from decode.evaluation.report import write_report

    ecfg = cfg.eval
    near_tie = ecfg.checks.near_tie_relative.get(cfg.model.dtype)
    if near_tie is None:
        raise EvalError(f"eval.checks.near_tie_relative has no tolerance for dtype {cfg.model.dtype!r}")
    confidence = checked_confidence(ecfg.get("confidence"))
    checks_cfg = OmegaConf.create({**OmegaConf.to_container(ecfg.checks), "near_tie_relative": near_tie,
                                   "confidence": confidence})
    removed = clean_stale([ecfg.out_dir, ecfg.publish.dir])
    report = evaluate(decoded, reference_fn, checks_cfg)
    speedups = {n: paired.Interval.from_dict(r["time_speedup_interval"]) for n, r in report["chains"].items()}
    decision = gate(report["checks"], speedups, str(ecfg.publish.chain), bool(ecfg.publish.force))
    report |= {"run_name": cfg.run_name, "gate": decision, "config": OmegaConf.to_container(ecfg, resolve=True),
               "questions": decoded.questions, "max_new_tokens": ecfg.max_new_tokens}
    out = write_report(report, ecfg.out_dir)
    tracker.summary(summary_metrics(report, decoded.names, decision))
    tracker.log_artifact(out, name=f"eval-{cfg.run_name}", type="eval-report")
    print((out / "report.md").read_text())  # the summary a pipeline run ends with
    for line in decision["failures"]:
        print(line, file=sys.stderr)
    for path in removed:
        print(f"removed a stale temp folder of an interrupted run: {path}")
    print(f"report: {out / 'report.md'}")
    if decision["publish"]:
        name = decision["chain"]
        manifest, folders = chain_manifest(cfg, name, decoded.chains[name], target_hash, report, decision)
        bundle = publish_bundle(ecfg.publish.dir, manifest, out, folders)
        tracker.log_artifact(bundle, name=f"chain-{cfg.run_name}", type="chain", metadata=manifest)
        print(f"published {name}{' (FORCED despite failed checks)' if decision['forced'] else ''}: {bundle}")
    else:
        print(f"not published: {decision['explanation']} ({len(decision['failures'])} failed check(s))")
        stale = set_aside(ecfg.publish.dir)
        if stale is not None:
            print(f"moved the previously published bundle aside to {stale}: this eval does not admit it")
    tracker.finish(out / "metrics.json")
    return 0 if decision["publish"] else EXIT_NOT_PUBLISHED


def summary_metrics(report: dict[str, Any], chains: dict[str, list[str]], decision: dict[str, Any]) -> dict[str, Any]:
    """The W&B summary of an eval: per chain its speedups, predictions, L_i and T_i, per category, per check."""
    results, summaries = report["chains"], report["summaries"]
    return {
        **{f"{n}/speedup": r["measured_speedup"] for n, r in results.items()},
        **{f"{n}/time_speedup": r["time_speedup"] for n, r in results.items()},
        **{f"{n}/time_speedup_low": r["time_speedup_interval"]["low"] for n, r in results.items()},
        **{f"{n}/{k}/predicted_speedup": p.get("speedup")
           for n, r in results.items() for k, p in r["predictions"].items()},
        **{f"{n}/{k}/prediction_error": p.get("error")
           for n, r in results.items() for k, p in r["predictions"].items()},
        **{f"{n}/L_{i + 1}": level["L_mean"]
           for n in chains for i, level in enumerate(summaries[n]["levels"][:-1])},
        **{f"{n}/T_{i + 1}_ms": (level["T_s"] or 0) * 1e3
           for n in chains for i, level in enumerate(summaries[n]["levels"])},
        **{f"{n}/{cat}/speedup": row[n]["speedup"] for cat, row in report["categories"].items() for n in chains},
        **{f"check/{c['name']}": c["passed"] for c in report["checks"]},
        "published": decision["publish"], "published_chain": decision["chain"] or "", "forced": decision["forced"],
    }


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_main(lambda: run(cfg))


if __name__ == "__main__":
    main()


if __name__ == "__main__":
    main()
