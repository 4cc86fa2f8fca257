"""The eval report: report.json, a Markdown summary with the paper's tables, and PNG plots."""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the headless backend)
from matplotlib.ticker import MaxNLocator  # noqa: E402

from data.tracking import replace_dir  # noqa: E402


def _f(value: Any, fmt: str = ".2f") -> str:
    return "n/a" if value is None else format(value, fmt)


def _ms(seconds: Any) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.2f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def markdown(report: dict[str, Any]) -> str:
    chains = list(report["chains"])
    lines = [f"# Chain evaluation: {report['run_name']}", ""]
    gate = report["gate"]
    lines += [f"**Gate: {gate['decision']}.** {gate['explanation']}", ""]
    lines += _table(["check", "result", "why"], [
        [c["name"], "pass" if c["passed"] else "FAIL", "; ".join(c["reasons"]) or "-"] for c in report["checks"]
    ])
    lossless = next(c for c in report["checks"] if c["name"] == "lossless")
    lines += ["", f"Lossless: {lossless['details']['compared_turns']} turns compared, "
              f"{len(lossless['details']['near_ties'])} near-ties excused (relative top-2 margin <= "
              f"{lossless['details']['near_tie_tolerance']:.0e}).", ""]

    lines += ["## Chains", ""]
    rows = []
    baselines = report.get("baselines", {})
    for name in ["ar", *baselines, *chains]:
        s = report["summaries"][name]
        res = report["chains"].get(name) or baselines.get(name, {})
        levels = s["levels"]
        rows.append([
            name, " <- ".join(l["name"] for l in levels), _f(s["tokens_per_s"], ".1f"),
            _f(res.get("measured_speedup", 1.0)), _f(res.get("time_speedup", 1.0)),
            _f(res.get("predicted_speedup", 1.0 if name == "ar" else None)),
            " / ".join(_ms(l["T_s"]) for l in levels),
            " / ".join(f"{_f(l['L_mean'])} (var {_f(l['L_var'])})" for l in levels[:-1]) or "-",
            _f(s["draft_depth"]), _f(res.get("prediction_error"), "+.0%"),
        ])
    lines += _table(["chain", "levels", "tok/s", "speedup", "time speedup", "Thm 3.1 speedup", "T_i ms",
                     "L_i (var)", "beta", "Thm 3.1 time error"], rows)
    lines += ["", "speedup: Spec-Bench's (mean tokens/s over the AR's); time speedup: AR seconds per token over the "
              "chain's, pooled over all turns, the quantity Theorem 3.1 predicts and the agreement check compares."]

    lines += ["", "## Per category", ""]
    rows = []
    for category, row in report["categories"].items():
        rows.append([category] + [
            f"{_f(row[n]['speedup'])}x, L {'/'.join(_f(x) for x in row[n]['L'])}" for n in chains
        ])
    lines += _table(["category", *chains], rows)

    lines += ["", "## Theorem 3.2: inserted levels (T in ms)", ""]
    rows = []
    for ins in report["insertions"]:
        v, t = ins["values"], ins.get("theorem_3_2", {})
        sp = ins.get("speedups", {})
        rows.append([
            f"{ins['level']} in {ins['with']} (vs {ins['without']})", _ms(v["T_i"]), _f(v["L_i_new"]), _ms(v["T_new"]),
            _f(v["L_new"]), _ms(v["T_next"]), _f(v["L_i"]), _f(t.get("lhs_first"), ".3f"), _f(t.get("rhs_first"), ".3f"),
            f"{_f(t.get('lhs_second'), '.3f')} < {_f(t.get('rhs_second'), '.3f')}",
            ins.get("error") or ("improves" if ins["improves"] else "rejected"),
            f"{_f(sp.get('without', {}).get('predicted'))}x -> {_f(sp.get('with', {}).get('predicted'))}x",
            f"{_f(sp.get('without', {}).get('measured'))}x -> {_f(sp.get('with', {}).get('measured'))}x",
        ])
    lines += _table(["insertion", "T_i", "L_i-new", "T_new", "L_new", "T_i+1", "L_i", "lhs T_new/T_i", "rhs",
                     "2nd: T_new/T_i+1 < rhs", "verdict", "Thm 3.1 speedup", "time speedup"], rows)
    lines += ["", "Plots: speedup_by_category.png, acceptance_<chain>.png, predicted_vs_measured.png.", ""]
    return "\n".join(lines)


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
    """One panel of whole-run totals per chain, one of single turns (each turn's own T_i, L_i, beta, N)."""
    from decode.theory import TheoryError, predicted_time

    fig, (total, turns) = plt.subplots(1, 2, figsize=(9, 4.5))
    for k, (name, res) in enumerate(report["chains"].items()):
        color = f"C{k}"
        if "predicted_time_s" in res:
            total.scatter([report["summaries"][name]["wall_time_s"]], [res["predicted_time_s"]], label=name, s=60, c=color)
        points = []
        for row in report["records"][name]:
            levels = row["levels"]
            try:
                points.append((row["wall_time_s"], predicted_time([l["T_s"] for l in levels], [l["L_mean"] for l in levels[:-1]],
                                                                  row["draft_depth"], len(row["tokens"]))))
            except TheoryError:
                continue  # a turn too short to measure every level
        if points:
            turns.scatter(*zip(*points), s=12, alpha=0.6, label=name, c=color)
    for ax, title in ((total, "whole run"), (turns, "per turn")):
        top = max([*ax.get_xlim(), *ax.get_ylim()])
        ax.plot([0, top], [0, top], color="gray", ls="--", lw=1)
        ax.set_xlabel("measured time (s)")
        ax.set_ylabel("Theorem 3.1 predicted time (s)")
        ax.set_title(title)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)



def write_report(report: dict[str, Any], out_dir: str | Path) -> Path:
    """Write report.json, report.md and the plots into a temp folder, then rename it to out_dir."""
    final = Path(out_dir)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        (tmp / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
        (tmp / "report.md").write_text(markdown(report))
        plot_speedups(report, tmp / "speedup_by_category.png")
        for name in report["chains"]:
            plot_acceptance(name, report["summaries"][name], tmp / f"acceptance_{name}.png")
        plot_predicted_vs_measured(report, tmp / "predicted_vs_measured.png")
        replace_dir(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
