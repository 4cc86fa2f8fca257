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
from omegaconf import DictConfig

from decode.evaluation import EvalError
from decode.evaluation import speedup as paired
from decode.evaluation.checks import ReferenceFn, evaluate_chains
from decode.evaluation.decoding import Decoded, build_decoders, decode_questions, decode_sampled, plan_chains
from decode.publish.bundle import chain_manifest, clean_stale, gate, publish_bundle, set_aside
from decode.settings import EvalSettings, eval_of
from infra.cli import EXIT_NOT_PUBLISHED, run_main
from infra.device import use_threads


def run(settings: EvalSettings) -> int:
    from data.models import weights_hash
    from data.prompts import load_questions
    from decode.chains.baselines import greedy_margins
    from decode.chains.build import builder_for, eos_of, load_target, refuse_unfit_layers
    from infra.cli import check_writable
    from infra.tracking import Tracker

    section, decoding = settings.section, settings.decoding
    check_writable(section.out_dir, "eval.out_dir", error=EvalError)  # fail now, not after the decoding
    check_writable(section.publish.dir, "eval.publish.dir", error=EvalError)
    questions = load_questions(section.prompts, section.per_category)
    for name, spec in settings.specs.items():  # named where it is set: eval.chains takes decode.chains' chains
        source = next((known for known, other in decoding.chains.items() if other == spec), None)
        where = f"decode.chains.{source}" if source else f"eval.chains.{name}"
        refuse_unfit_layers(spec, where, decoding.model.name, decoding.layout)
    use_threads(decoding.section.threads, "decode.threads")
    prepared, tokenizer = load_target(decoding)
    target = prepared.model
    builder, eos = builder_for(decoding, prepared, tokenizer), eos_of(target, tokenizer)
    decoders = build_decoders(settings, builder, eos)
    tracker = Tracker(settings.tracking, "eval")
    for art in section.publish.lineage:  # this run consumed the head and the W4 model those stages logged
        tracker.use_artifact(art.name, art.type)
    plans = plan_chains(settings, builder, decoders, questions, eos) if settings.plan.enabled else {}
    records = decode_questions(decoders, questions, tokenizer, section.max_new_tokens, section.warmup_tokens)
    t33 = section.theorem_3_3
    sampled = decode_sampled({n: decoders[n] for n in settings.specs}, questions[: t33.questions], tokenizer,
                             section.max_new_tokens, t33.temperature, t33.seed) if t33.questions else {}
    chains = ({name: spec.as_config() for name, spec in settings.specs.items()}
              | {p["chain"]: p["levels"] for p in plans.values() if "planned" in p["decoded"]})
    decoded = Decoded(records, chains, len(questions), plans, sampled)

    def reference_fn(prompt: list[int], forced: list[int], n: int):
        return greedy_margins(prepared, prompt, forced, n, eos)

    return conclude(settings, decoded, reference_fn, weights_hash(target), tracker)


def conclude(settings: EvalSettings, decoded: Decoded, reference_fn: ReferenceFn,
             target_hash: str, tracker: Any) -> int:
    """From decoded records to the gate: evaluate the chains, write the report, publish or refuse; the exit code."""
    from decode.evaluation.report import write_report

    section, publish, run_name = settings.section, settings.publish, settings.decoding.run_name
    removed = clean_stale([section.out_dir, publish.dir])
    report = evaluate_chains(decoded, reference_fn, settings.checks,
                             settings.checks.near_tie(settings.decoding.model.dtype))
    speedups = {n: paired.Interval.from_dict(r["time_speedup_interval"]) for n, r in report["chains"].items()}
    decision = gate(report["checks"], speedups, publish.chain, publish.force)
    report |= {"run_name": run_name, "gate": decision, "config": settings.config,
               "questions": decoded.questions, "max_new_tokens": section.max_new_tokens}
    out = write_report(report, section.out_dir)
    tracker.summary(summary_metrics(report, decoded.names, decision))
    tracker.log_artifact(out, name=f"eval-{run_name}", type="eval-report")
    print((out / "report.md").read_text())  # the summary a pipeline run ends with
    for line in decision["failures"]:
        print(line, file=sys.stderr)
    for path in removed:
        print(f"removed a stale temp folder of an interrupted run: {path}")
    print(f"report: {out / 'report.md'}")
    if decision["publish"]:
        name = decision["chain"]
        manifest, folders = chain_manifest(settings.publication, name, decoded.chains[name], target_hash, report,
                                           decision)
        bundle = publish_bundle(publish.dir, manifest, out, folders)
        tracker.log_artifact(bundle, name=f"chain-{run_name}", type="chain", metadata=manifest)
        print(f"published {name}{' (FORCED despite failed checks)' if decision['forced'] else ''}: {bundle}")
    else:
        print(f"not published: {decision['explanation']} ({len(decision['failures'])} failed check(s))")
        stale = set_aside(publish.dir)
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
    run_main(lambda: run(eval_of(cfg)))


if __name__ == "__main__":
    main()
