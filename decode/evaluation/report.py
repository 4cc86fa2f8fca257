"""The eval report: report.json, a Markdown summary with the paper's tables, and PNG plots."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the headless backend)
from matplotlib.ticker import MaxNLocator  # noqa: E402

from infra.tracking import atomic_dir  # noqa: E402


def _f(value: Any, fmt: str = ".2f") -> str:
    return "n/a" if value is None else format(value, fmt)


def _ms(seconds: Any) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.2f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def _error(prediction: dict[str, Any]) -> str:
    bounds = prediction.get("error_interval")
    return _f(prediction.get("error"), "+.0%") + (f" [{bounds[0]:+.0%}, {bounds[1]:+.0%}]" if bounds else "")


def _interval(result: dict[str, Any], key: str = "time_speedup_interval") -> str:
    """'<estimate>x [<low>, <high>]: not shown to be faster' (decode.evaluation.speedup), or the point alone (AR against
    itself)."""
    interval = result.get(key)
    return interval["text"] if interval else _f(result.get("time_speedup", 1.0))


def markdown(report: dict[str, Any]) -> str:
    """report.md: the gate's decision and the checks first, then one section per part of the report."""
    lines = _gate_section(report) + _chains_section(report) + _plan_section(report) + _theorem_3_3_section(report)
    lines += _categories_section(report) + _insertions_section(report)
    lines += ["", "Plots: speedup_by_category.png, acceptance_<chain>.png, predicted_vs_measured.png.", ""]
    return "\n".join(lines)


def _gate_section(report: dict[str, Any]) -> list[str]:
    """The title, what was published or why nothing was, and every check with its reasons."""
    gate = report["gate"]
    lines = [f"# Chain evaluation: {report['run_name']}", ""]
    lines += [f"**Published: {gate['chain']}.** {gate['explanation']}" if gate["publish"] else
              f"**Gate: not published.** {gate['explanation']}", ""]
    for name, reasons in gate["rejected"].items():
        lines.append(f"- rejected {name}: " + "; ".join(reasons))
    agreement = next(c for c in report["checks"] if c["name"] == "agreement")["details"]
    lines += ["", f"Admissible: lossless, every inserted level passes Theorem 3.2, the {agreement['prediction']} "
              f"prediction within {agreement['tolerance']:.0%} of the measured decoding time "
              "(unless its interval overlaps the tolerance), and shown faster than AR: "
              f"the lower bound of its speedup's {report['config']['confidence']:.0%} "
              "interval (paired over turns) above 1, "
              f"multiple-comparison correction: {gate.get('correction', 'none')}. "
              "The admissible chain with the highest lower bound is published.", ""]
    lines += _table(["check", "result", "why"], [
        [c["name"], "pass" if c["passed"] else "FAIL", "; ".join(c["reasons"]) or "-"] for c in report["checks"]
    ])
    lossless = next(c for c in report["checks"] if c["name"] == "lossless")
    lines += ["", f"Lossless: {lossless['details']['compared_turns']} turns compared, "
              f"{len(lossless['details']['near_ties'])} near-ties excused (relative top-2 margin <= "
              f"{lossless['details']['near_tie_tolerance']:.0e}).", ""]
    return lines


def _chains_section(report: dict[str, Any]) -> list[str]:
    """AR, the baselines and every chain: speed, both predictions, T_i and L_i per level."""
    from decode.evaluation.measure import level_line, prediction_line

    chains, baselines = list(report["chains"]), report.get("baselines", {})
    rows = []
    for name in ["ar", *baselines, *chains]:
        s = report["summaries"][name]
        res = report["chains"].get(name) or baselines.get(name, {})
        pred = res.get("predictions", {})
        levels = s["levels"]
        rows.append([
            name, " <- ".join(level["name"] for level in levels), _f(s["tokens_per_s"], ".1f"),
            _f(res.get("measured_speedup", 1.0)), _interval(res),
            _f(pred.get("paper", {}).get("speedup")), _f(pred.get("refined", {}).get("speedup")),
            " / ".join(_ms(level["T_s"]) for level in levels),
            " / ".join(f"{_f(level['L_mean'])} (var {_f(level['L_var'])})" for level in levels[:-1]) or "-",
            _f(s["draft_depth"]), _error(pred.get("paper", {})), _error(pred.get("refined", {})),
        ])
    lines = ["## Chains", ""]
    lines += _table(["chain", "levels", "tok/s", "speedup", "time speedup [interval]", "Thm 3.1 speedup",
                     "refined speedup", "T_i ms", "L_i (var)", "beta", "Thm 3.1 time error",
                     "refined time error"], rows)
    lines += ["", "speedup: Spec-Bench's (mean tokens/s over the AR's); time speedup: AR seconds per token over the "
              "chain's, pooled over all turns, with its paired interval over turns "
              "(decode.evaluation.speedup; the gate needs its lower bound above 1). "
              "Time errors: predicted decoding time (after the first token) over the measured one, minus 1, "
              "with the turns' spread as an interval. Theorem 3.1 is the paper's formula; the refined "
              "prediction counts each middle level's rounds from the tokens it hands up (P) "
              "and those the level above keeps.",
              "", "Per level (T = ms per forward, L = acceptance length, P = tokens handed up per round; "
              "as decode.bench prints it):", ""]
    lines += [f"- {name}: {level_line(report['summaries'][name])} | {prediction_line(report['summaries'][name])}"
              for name in chains]
    return lines


def _plan_section(report: dict[str, Any]) -> list[str]:
    """decode.chains.plan's choice per chain, predicted against measured, and what each plan was calibrated on."""
    if not report.get("plans"):
        return []
    rows = []
    for base, plan in report["plans"].items():
        for side, name in (("configured", base), ("planned", plan["chain"])):
            if side not in plan:  # a searched stack: only the planner's knobs
                continue
            k, pr = plan[side]["knobs"], plan[side]
            label = "stack" if plan.get("stack") else side
            rows.append([f"{name} ({label})", ", ".join(f"{n}={m}" for n, m in k["mu"].items()) or "-",
                         ", ".join(f"{a}={b}" for a, b in k["draft"].items() if a != "mode")
                         + f" ({k['draft']['mode']})",
                         _ms(pr["predicted"]["s_per_token"]), _ms(pr.get("measured_s_per_token")),
                         _f(pr.get("error"), "+.0%"), _f(pr.get("cost_error"), "+.0%"),
                         _lengths(pr["predicted"]["L"], pr.get("measured_L")),
                         _f(pr["predicted"]["speedup"]), _f(pr.get("measured_speedup"))])
    lines = ["", "## Plan (decode.chains.plan)", ""]
    lines += _table(["chain", "mu", "draft", "predicted ms/token", "measured ms/token", "error",
                     "error at the eval's L", "L predicted / measured", "predicted speedup", "measured speedup"],
                    rows)
    lines += ["", "Decoding time after the first token; speedups over AR's own decoding (predicted: the target's "
              "1-token forward from the same cost curve), which cancels load that changed since the calibration. "
              "A stack is a chain the configured chains' levels allow that none of them is (eval.plan.stacks: the "
              "fastest predicted are decoded; the others show no measurement). The error at the eval's L is the "
              "plan's costs (curves, the drafter's forward, overheads, the prompt reading) on what the eval's "
              "decodes measured (each level's acceptance, hand-ups, draft forwards a round, tokens a forward), "
              "against the measured time: what is left is the cost model's error and the host's load since the "
              "calibration; the rest of the error is acceptance, the calibration prompts' not the eval's.", ""]
    for base, plan in report["plans"].items():
        cal = plan["calibration"]
        costs = ", ".join(f"{n} ({c['source']}, x{c['scale']:.2f})" for n, c in cal["costs"].items())
        lines.append(f"- {base}: {plan['candidates']} configurations predicted "
                     f"from {cal['decodes']} calibration decodes "
                     f"({cal['prompts']} held-out prompts x {cal['max_new_tokens']} tokens, mu {cal['mu']}, "
                     f"{cal['seconds']:.0f}s); cost curves: {costs}; {_overheads(cal['overhead_ms'])}.")
    return lines


def _lengths(predicted: list[float], measured: list[float] | None) -> str:
    """Each verifying level's acceptance length, as the calibration predicted it / as the eval measured it: an error
    from acceptance (the calibration prompts' text is not the eval's) against one from costs."""
    shown = " ".join(f"{x:.2f}" for x in predicted)
    return shown if measured is None else f"{shown} / {' '.join(_f(x) for x in measured)}"


def _overheads(ms: dict[str, Any]) -> str:
    """A calibration's overheads beside the forwards: per round of each upper level, of the last verifier per draft."""
    upper = "".join(f"level {i} {o:.2f}, " for i, o in enumerate(ms["upper levels"], 1))
    last = ", ".join(f"{name} {o:.2f}" for name, o in ms["last verifier"].items())
    return f"overhead ms a round: {upper}last verifier at {last}"


def _theorem_3_3_section(report: dict[str, Any]) -> list[str]:
    """Acceptance-length variance per level, greedy against sampling, next to the paper's claim."""
    if not report.get("theorem_3_3"):
        return []
    lines = ["", "## Theorem 3.3: acceptance-length variance, greedy vs sampling", "",
             "The paper's claim: with speculative sampling the acceptance length is stable, its variance lower "
             "than with greedy decoding. Measured on the same first turns, sampling at temperature "
             f"{report['config']['theorem_3_3']['temperature']}:", ""]
    rows = [[name, r["level"], f"{_f(r['greedy']['L'])} ({_f(r['greedy']['var'])})",
             f"{_f(r['sampling']['L'])} ({_f(r['sampling']['var'])})",
             f"{r['greedy']['verifications']} / {r['sampling']['verifications']}",
             {True: "holds", False: "does not hold", None: "n/a"}[r["claim_holds"]]]
            for name, rows_ in report["theorem_3_3"].items() for r in rows_]
    return lines + _table(["chain", "level", "greedy L (var)", "sampling L (var)", "verifications", "claim"], rows)


def _categories_section(report: dict[str, Any]) -> list[str]:
    """Each chain's speedups and acceptance lengths per question category."""
    chains = list(report["chains"])
    rows = [[category] + [f"{_f(row[n]['speedup'])}x, time {_interval(row[n])}, "
                          f"L {'/'.join(_f(x) for x in row[n]['L'])}"
                          for n in chains]
            for category, row in report["categories"].items()]
    return ["", "## Per category", "",
            "Spec-Bench's speedup, then the time speedup with its interval over the category's turns.",
            ""] + _table(["category", *chains], rows)


def _insertions_section(report: dict[str, Any]) -> list[str]:
    """Theorem 3.2 for every inserted level: the measured values, both conditions, the verdict, the speedups."""
    rows = []
    for ins in report["insertions"]:
        v, t = ins["values"], ins.get("theorem_3_2", {})
        sp = ins.get("speedups", {})
        rows.append([
            f"{ins['level']} in {ins['with']} (vs {ins['without']})", _ms(v["T_i"]), _f(v["L_i_new"]), _ms(v["T_new"]),
            _f(v["L_new"]), _ms(v["T_next"]), _f(v["L_i"]), _f(t.get("lhs_first"), ".3f"),
            _f(t.get("rhs_first"), ".3f"),
            f"{_f(t.get('lhs_second'), '.3f')} < {_f(t.get('rhs_second'), '.3f')}",
            ins.get("error") or ("improves" if ins["improves"] else "rejected"),
            f"{_f(sp.get('without', {}).get('predicted'))}x -> {_f(sp.get('with', {}).get('predicted'))}x",
            f"{_f(sp.get('without', {}).get('measured'))}x -> {_f(sp.get('with', {}).get('measured'))}x "
            f"(with/without {_interval(ins, 'measured_gain')})",
        ])
    return ["", "## Theorem 3.2: inserted levels (T in ms)", ""] + _table(
        ["insertion", "T_i", "L_i-new", "T_new", "L_new", "T_i+1", "L_i", "lhs T_new/T_i", "rhs",
         "2nd: T_new/T_i+1 < rhs", "verdict", "Thm 3.1 speedup", "time speedup"], rows)


def plot_speedups(report: dict[str, Any], path: Path) -> None:
    chains, categories = list(report["chains"]), list(report["categories"])
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(categories)), 4))
    width = 0.8 / max(len(chains), 1)
    for k, name in enumerate(chains):
        values = [report["categories"][c][name]["speedup"] for c in categories]
        ax.bar([i + k * width for i in range(len(categories))], values, width, label=name)
    ax.axhline(1.0, color="gray", lw=1, ls="--")
    ax.set_xticks([i + width * (len(chains) - 1) / 2 for i in range(len(categories))], categories, rotation=20)
    ax.set_ylabel("speedup over AR")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_acceptance(name: str, summary: dict[str, Any], path: Path) -> None:
    verifiers = summary["levels"][:-1]
    fig, axes = plt.subplots(1, len(verifiers), figsize=(4 * len(verifiers), 3.2), squeeze=False)
    for ax, level in zip(axes[0], verifiers):
        hist = {int(k): v for k, v in level["L_histogram"].items()}
        ax.bar(list(hist), list(hist.values()))
        ax.set_title(f"{level['name']}: L={_f(level['L_mean'])}, var {_f(level['L_var'])}")
        ax.set_xlabel("acceptance length (bonus included)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(name)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_predicted_vs_measured(report: dict[str, Any], path: Path) -> None:
    """Decoding time predicted against measured: whole-run totals per chain (Theorem 3.1 and the refined
    prediction), and single turns (each turn's own measurements, refined prediction)."""
    fig, (total, turns) = plt.subplots(1, 2, figsize=(9, 4.5))
    for k, name in enumerate(report["chains"]):
        color, summary = f"C{k}", report["summaries"][name]
        for kind, marker in (("paper", "x"), ("refined", "o")):
            p = summary["predictions"][kind]
            if "time_s" in p:
                total.scatter([summary["decode_time_s"]], [p["time_s"]], marker=marker, s=60, c=color,
                              label=f"{name} ({'Thm 3.1' if kind == 'paper' else 'refined'})")
        points = [(row["decode_time_s"], row["predicted_time_s"]["refined"]) for row in report["records"][name]
                  if row["predicted_time_s"].get("refined") is not None]
        if points:
            turns.scatter(*zip(*points), s=12, alpha=0.6, label=name, c=color)
    for ax, title in ((total, "whole run"), (turns, "per turn (refined)")):
        top = max([*ax.get_xlim(), *ax.get_ylim()])
        ax.plot([0, top], [0, top], color="gray", ls="--", lw=1)
        ax.set_xlabel("measured decoding time (s)")
        ax.set_ylabel("predicted decoding time (s)")
        ax.set_title(title)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(report: dict[str, Any], out_dir: str | Path) -> Path:
    """Write report.json, report.md and the plots into a temp folder, then rename it to out_dir."""
    final = Path(out_dir)
    with atomic_dir(final) as tmp:
        (tmp / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
        (tmp / "report.md").write_text(markdown(report))
        plot_speedups(report, tmp / "speedup_by_category.png")
        for name in report["chains"]:
            plot_acceptance(name, report["summaries"][name], tmp / f"acceptance_{name}.png")
        plot_predicted_vs_measured(report, tmp / "predicted_vs_measured.png")
    return final
