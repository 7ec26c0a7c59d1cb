"""Scaling-law report of a sweep folder: CSV of runs, fitted laws, figures in the paper's form.

Reads every ``<sweep>/*/result.json`` (written by :mod:`lit.sweep`) and writes, into the
sweep folder:

- ``runs.csv``: each run's size, attention type, parameters, tokens, compute (6·N·D and
  with attention) and losses (whole sequence, trailing window, every position window);
- ``report.md``: fitted ``L = a · C^b`` per window and attention type, in the MoBA paper's
  Table 3 form, with standard errors, bootstrap intervals and projected crossovers;
- ``scaling.png``: log-log loss vs PFLOP/s-days, one panel per window plus the whole
  sequence, measured points and dashed projections extended beyond the measured range.

    flexmoba scaling-report --sweep_dir runs/sweep-toy
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

from lit.command_line import fail, parse_dataclass
from lit.scaling_law import PowerLaw, crossover, fit_power_law

WHOLE, TRAILING, POSITION_PREFIX = "val/loss", "val/loss_trailing", "val/loss_pos_"
PROJECTION_SPAN = 10.0  # dashed lines reach this factor beyond the measured compute range


def load_results(sweep_dir: Path) -> list[dict]:
    results = [json.loads(p.read_text()) for p in sorted(Path(sweep_dir).glob("*/result.json"))]
    if not results:
        raise ValueError(f"no finished runs (*/result.json) in sweep folder {sweep_dir}")
    return results


def window_keys(results: list[dict]) -> list[str]:
    """Metric keys to fit: whole sequence, trailing window, then position windows in order."""
    keys = {k for r in results for k in r["metrics"]}
    positions = sorted(k for k in keys if k.startswith(POSITION_PREFIX))
    return [k for k in (WHOLE, TRAILING) if k in keys] + positions


def window_label(key: str) -> str:
    if key == WHOLE:
        return "whole sequence"
    if key == TRAILING:
        return "trailing window"
    start, end = (int(x) for x in key[len(POSITION_PREFIX):].split("_"))
    return f"positions {_tokens(start)}-{_tokens(end)}"


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 and n else str(n)


def write_csv(results: list[dict], keys: list[str], path: Path) -> None:
    columns = ["run", "size", "attention", "params_non_embedding", "tokens", "steps", "compute_6nd",
               "compute_total", "seconds"]
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns + keys)
        for r in results:
            writer.writerow([r[c] for c in columns] + [r["metrics"].get(k, "") for k in keys])


def fit_all(results: list[dict], keys: list[str], compute_key: str = "compute_6nd",
            bootstrap: int = 200) -> dict[tuple[str, str], PowerLaw]:
    """``(window key, attention) -> PowerLaw`` for every pair with at least 2 distinct sizes."""
    laws = {}
    for attention in sorted({r["attention"] for r in results}):
        runs = [r for r in results if r["attention"] == attention]
        for key in keys:
            points = [(r[compute_key], r["metrics"][key]) for r in runs if key in r["metrics"]]
            if len({c for c, _ in points}) < 2:
                continue
            compute, loss = zip(*points, strict=True)
            laws[key, attention] = fit_power_law(compute, loss, bootstrap=bootstrap)
    return laws


def _law_cell(law: PowerLaw | None) -> str:
    if law is None:
        return "n/a"
    if law.n_points < 3:
        return f"{law.formula()} ({law.n_points} points: exact fit, no error estimate)"
    low, high = law.b_t_interval()
    cell = f"{law.formula()} (±{law.b_stderr:.3f} on b; 95% t: [{low:.3f}, {high:.3f}]"
    if law.b_interval:
        cell += f"; bootstrap [{law.b_interval[0]:.3f}, {law.b_interval[1]:.3f}]"
    return cell + ")"


def _crossover_cell(laws, key, attentions) -> str:
    if len(attentions) != 2 or (key, attentions[0]) not in laws or (key, attentions[1]) not in laws:
        return "n/a"
    c_star = crossover(laws[key, attentions[0]], laws[key, attentions[1]])
    return "parallel" if c_star is None else f"{c_star:.3g}"


def markdown(results, keys, laws, laws_total) -> str:
    attentions = sorted({r["attention"] for r in results})
    lines = [
        "# Scaling-law report: MoBA vs full attention",
        "",
        f"{len(results)} runs, {len({r['size'] for r in results})} model sizes. Compute C in PFLOP/s-days; "
        "fits are least squares of log L on log C, ± the standard error of the exponent b, "
        "95% bootstrap intervals over runs.",
        "",
        "## Fitted laws, C = 6·N·D (the paper's Table 3 form)",
        "",
        "| window | " + " | ".join(attentions) + " | crossover C |",
        "|---|" + "---|" * (len(attentions) + 1),
    ]
    for key in keys:
        cells = [_law_cell(laws.get((key, a))) for a in attentions]
        lines.append(f"| {window_label(key)} | " + " | ".join(cells) + f" | {_crossover_cell(laws, key, attentions)} |")
    lines += [
        "",
        "## Fitted laws, C = FLOPs really spent (6·N·D plus attention)",
        "",
        "| window | " + " | ".join(attentions) + " |",
        "|---|" + "---|" * len(attentions),
    ]
    for key in keys[:2]:
        cells = [_law_cell(laws_total.get((key, a))) for a in attentions]
        lines.append(f"| {window_label(key)} | " + " | ".join(cells) + " |")
    lines += ["", "## Runs", "", "| run | params (non-emb.) | tokens | C (6ND) | C (total) | loss | trailing |",
              "|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r["attention"], r["compute_6nd"])):
        whole, trailing = (r["metrics"].get(key, float("nan")) for key in (WHOLE, TRAILING))
        lines.append(f"| {r['run']} | {r['params_non_embedding']:,} | {r['tokens']:,} | {r['compute_6nd']:.3g} | "
                     f"{r['compute_total']:.3g} | {whole:.4f} | {trailing:.4f} |")
    lines += ["", "![scaling](scaling.png)", ""]
    return "\n".join(lines)


def plot(results, keys, laws, path: Path, compute_key: str = "compute_6nd") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    attentions = sorted({r["attention"] for r in results})
    colors = {a: c for a, c in zip(attentions, ["tab:red", "tab:blue", "tab:green", "tab:purple"], strict=False)}
    cols = min(4, len(keys))
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    compute = [r[compute_key] for r in results]
    lo, hi = min(compute) / PROJECTION_SPAN, max(compute) * PROJECTION_SPAN
    grid = [lo * (hi / lo) ** (i / 63) for i in range(64)]
    for ax, key in zip(axes.flat, keys, strict=False):
        for attention in attentions:
            runs = [r for r in results if r["attention"] == attention and key in r["metrics"]]
            ax.scatter([r[compute_key] for r in runs], [r["metrics"][key] for r in runs],
                       color=colors[attention], s=18, zorder=3)
            law = laws.get((key, attention))
            if law is not None:
                ax.plot(grid, law(grid).tolist(), "--", color=colors[attention],
                        label=f"{attention} projection: {law.formula()}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"LM loss, {window_label(key)}", fontsize=10)
        ax.set_xlabel("PFLOP/s-days")
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(sweep_dir: Path, bootstrap: int = 200) -> Path:
    """Write ``runs.csv``, ``report.md`` and ``scaling.png`` into ``sweep_dir``; return the report path."""
    sweep_dir = Path(sweep_dir)
    results = load_results(sweep_dir)
    keys = window_keys(results)
    write_csv(results, keys, sweep_dir / "runs.csv")
    laws = fit_all(results, keys, "compute_6nd", bootstrap)
    laws_total = fit_all(results, keys[:2], "compute_total", bootstrap)
    plot(results, keys, laws, sweep_dir / "scaling.png")
    report = sweep_dir / "report.md"
    report.write_text(markdown(results, keys, laws, laws_total))
    return report


@dataclass
class ReportJob:
    """What ``flexmoba scaling-report`` rebuilds.

    Args:
        sweep_dir: a sweep folder holding ``*/result.json`` (the sweep's ``out_dir``).
        bootstrap: bootstrap resamples for the fits' intervals.
    """

    sweep_dir: str
    bootstrap: int = 200


def main(argv: list[str] | None = None) -> None:
    job = parse_dataclass(ReportJob, argv, prog="flexmoba scaling-report", description=__doc__)
    try:
        report = write_report(Path(job.sweep_dir), job.bootstrap)
    except ValueError as error:
        fail("flexmoba scaling-report", str(error))
    print(f"report: {report}")
