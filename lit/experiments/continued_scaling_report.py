"""The report of a continued-scaling study: loss at late positions against training compute, per arm.

    flexmoba continued-scaling-report --study ~/flexmoba-runs/smollm2-scaling --out docs/pretrained/scaling
    flexmoba continued-scaling-report --study docs/pretrained/scaling/records --out /tmp/again   # from the copy

Reads a study folder (``study.json``, ``study.jsonl`` and every evaluation's ``records.jsonl``), copies those
records into ``<out>/records/`` (the report can be rebuilt from them alone), and writes ``results.md``,
``results.json``, ``loss_vs_compute.png`` and ``gap_vs_compute.png``.

- **Windows** at the reference figures' relative positions: 14–16K and 20–22K of 32K are 7/16–8/16 and
  10/16–11/16 of the sequence (3.5–4K and 5–5.5K of 8K), the last eighth (the last 1K of 8K) and the
  trailing positions. A document's window loss is the mean of its scored windows inside it.
- **Compute** of a budget: ``steps x batch x seq_len`` tokens times the training FLOPs per token of its arm,
  ``6 N + 3 x 4 H D x (keys attended per query)`` summed over layers (N non-embedding parameters; MoBA's
  layers attend its selected chunks only), in PFLOP/s-days (8.64e19 FLOPs).
- **Intervals**: 95% Student t over documents; differences to full attention are paired by document.
- **Projections**: per arm and window ``L = a C^b`` fitted by least squares in log-log space to the trained
  budgets; the gap MoBA - full fitted the same way where it is positive; the meeting point is where the
  two loss fits cross, with a 95% percentile interval from resampling documents (the same draw for every
  arm and budget) and the share of draws in which the fits meet ahead of the largest budget.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lit.experiments.context_eval import FULL, REFERENCE_WINDOWS, Arm, read_records
from lit.experiments.scaling_law import crossover, fit_power_law, pflops_days
from lit.training import figures
from lit.training.errors import UsageError
from lit.training.options import parse_dataclass
from lit.training.statistics import mean_interval

DRAWS = 1000
# (label, start, end) as shares of the sequence: the reference figures' windows of 32K, the last eighth
WINDOWS = (*REFERENCE_WINDOWS, ("last eighth", 7 / 8, 1.0))
COLORS = {FULL: "tab:red"}
MOBA_COLORS = ("tab:blue", "tab:green", "tab:purple", "tab:orange")


@dataclass
class ReportJob:
    """What ``flexmoba continued-scaling-report`` reads and writes.

    Args:
        study: a continued-scaling study's folder (or the ``records/`` copy a report made).
        out: the folder for the report (its ``records/`` copy included).
    """

    study: str
    out: str


# -- reading ----------------------------------------------------------------------------------


def arm_dir(arm: str) -> str:
    return arm.replace(":", "_")


def eval_records_path(study: Path, arm: str, budget: int) -> Path:
    return study / arm_dir(arm) / f"b{budget}" / "eval" / "records.jsonl"


def read_study(folder: Path) -> tuple[dict, list[dict], dict]:
    """The settings, the finished parts and ``{(arm, budget): eval records}`` of the finished evaluations."""
    if not (folder / "study.json").is_file():
        raise UsageError("--study", f"{folder} holds no continued-scaling study (no study.json)",
                         "give the --out of flexmoba continued-scaling, or a report's records/ folder")
    settings = json.loads((folder / "study.json").read_text())
    parts = read_records(folder / "study.jsonl")
    evals = {(p["arm"], p["budget"]): read_records(eval_records_path(folder, p["arm"], p["budget"]))
             for p in parts if p["part"] == "eval"}
    return settings, parts, evals


def copy_records(study: Path, out: Path, parts: list[dict]) -> None:
    """The study's records under ``out/records`` in the study's own layout."""
    target = out / "records"
    if target.resolve() == study.resolve():
        return
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    for name in ("study.json", "study.jsonl"):
        shutil.copyfile(study / name, target / name)
    for p in parts:
        if p["part"] == "eval":
            source = eval_records_path(study, p["arm"], p["budget"])
            destination = eval_records_path(target, p["arm"], p["budget"])
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, destination)
            if (source.parent / "machine.txt").is_file():  # a copy's copy
                shutil.copyfile(source.parent / "machine.txt", destination.parent / "machine.txt")
            machine = source.parent / "results.md"
            if machine.is_file():
                line = next((x for x in machine.read_text().splitlines() if x.startswith("Machine: ")), None)
                if line:
                    (destination.parent / "machine.txt").write_text(line.removeprefix("Machine: ") + "\n")


# -- numbers ----------------------------------------------------------------------------------


def window_spans(settings: dict) -> list[tuple[str, int, int]]:
    """``(label, first, end)``: each report window as a range of the scored windows."""
    width, length = settings["eval_window"], settings["eval_seq_len"]

    def tokens(n: int) -> str:
        return f"{n / 1024:g}K" if n >= 1024 and n % 512 == 0 else str(n)

    spans = []
    for name, start, end in WINDOWS:
        first, last = math.floor(start * length / width), max(math.floor(start * length / width) + 1,
                                                              math.ceil(end * length / width))
        spans.append((f"{tokens(first * width)}–{tokens(last * width)} ({name})", first, last))
    return spans


def window_values(records: list[dict], settings: dict, documents: list[str]) -> np.ndarray:
    """``[documents, windows + 1]``: each document's loss in every report window and its trailing loss."""
    by_document = {r["document"]: r for r in records if r["kind"] == "position"}
    spans = window_spans(settings)
    rows = []
    for document in documents:
        scored = by_document[document]["windows"]
        means = [float(np.mean(scored[first:end])) for _, first, end in spans]
        rows.append([*means, by_document[document]["trailing"]])
    return np.array(rows)


def window_labels(settings: dict) -> list[str]:
    return [name for name, _, _ in window_spans(settings)] + [f"last {settings['eval_trailing']}"]


def compute_of(settings: dict, arm: str, budget: int) -> float:
    """PFLOP/s-days of ``budget`` steps of continued training of ``arm``."""
    from lit.experiments.continued_scaling import training_flops_per_token

    data = settings["data"]["init_args"]
    tokens = budget * data["batch_size"] * data["seq_len"]
    return pflops_days(tokens * training_flops_per_token(settings, Arm.parse(arm)))


def common_documents(evals: dict) -> list[str]:
    sets = [{r["document"] for r in records if r["kind"] == "position"} for records in evals.values()]
    return sorted(set.intersection(*sets)) if sets else []


def fits(values: dict, computes: dict, arms: list[str], budgets: list[int], n_windows: int) -> dict:
    """``{(arm, window): PowerLaw}`` from the document means of the trained budgets (two at least)."""
    laws = {}
    for arm in arms:
        trained = [b for b in budgets if b > 0 and (arm, b) in values]
        if len(trained) < 2:
            continue
        for w in range(n_windows):
            laws[(arm, w)] = fit_power_law([computes[(arm, b)] for b in trained],
                                           [values[(arm, b)][:, w].mean() for b in trained])
    return laws


def meeting(laws: dict, arm: str, w: int, largest: float) -> float | None:
    """Compute where ``arm``'s fit meets full attention's ahead of ``largest``, or None."""
    if (arm, w) not in laws or (FULL, w) not in laws:
        return None
    at = crossover(laws[(arm, w)], laws[(FULL, w)])
    return at if at is not None and at > largest else None


def bootstrap_meeting(values: dict, computes: dict, arms: list[str], budgets: list[int], arm: str, w: int,
                      n_documents: int, seed: int = 0) -> dict:
    """The meeting point's 95% percentile interval over document resamples, and the share that meet."""
    rng = np.random.default_rng(seed)
    largest = max(computes[(a, b)] for a, b in computes if a in (arm, FULL) and b > 0)
    points = []
    for _ in range(DRAWS):
        draw = rng.integers(0, n_documents, n_documents)
        drawn = {key: v[draw] for key, v in values.items()}
        laws = fits(drawn, computes, [arm, FULL], budgets, w + 1)
        points.append(meeting(laws, arm, w, largest))
    met = [p for p in points if p is not None]
    interval = [float(x) for x in np.percentile(met, [2.5, 97.5])] if len(met) >= 20 else None
    return {"share_meeting": len(met) / DRAWS, "interval": interval}


def summarize(settings: dict, parts: list[dict], evals: dict) -> dict:
    arms, budgets = settings["arms"], [0, *settings["budgets"]]
    documents = common_documents(evals)
    labels = window_labels(settings)
    values = {key: window_values(records, settings, documents) for key, records in evals.items()}
    computes = {(arm, b): compute_of(settings, arm, b) for arm in arms for b in budgets}
    laws = fits(values, computes, arms, budgets, len(labels))
    table = []
    for (arm, budget), v in sorted(values.items(), key=lambda kv: (arms.index(kv[0][0]), kv[0][1])):
        row = {"arm": arm, "budget": budget, "compute_pflops_days": computes[(arm, budget)],
               "loss": [mean_interval(list(v[:, w])) for w in range(len(labels))]}
        if arm != FULL and (FULL, budget) in values:
            row["minus_full"] = [mean_interval(list(v[:, w] - values[(FULL, budget)][:, w]))
                                 for w in range(len(labels))]
        table.append(row)
    projections = []
    for arm in arms:
        for w in range(len(labels)):
            if (arm, w) not in laws:
                continue
            entry = {"arm": arm, "window": labels[w], "a": laws[(arm, w)].a, "b": laws[(arm, w)].b,
                     "budgets": [b for b in budgets if b > 0 and (arm, b) in values]}
            if arm != FULL and (FULL, w) in laws:
                largest = max(computes[(a, b)] for a in (arm, FULL) for b in budgets if b > 0 and (a, b) in values)
                entry["meets_full_at"] = meeting(laws, arm, w, largest)
                entry["meeting_bootstrap"] = bootstrap_meeting(values, computes, arms, budgets, arm, w, len(documents))
                entry["gap_fit"] = gap_fit(values, computes, arm, budgets, w)
            projections.append(entry)
    return {"documents": documents, "windows": labels, "table": table, "projections": projections,
            "retrieval": retrieval_grids(evals), "parts": parts_summary(settings, parts),
            "computes": {f"{a} {b}": c for (a, b), c in computes.items()}}


def gap_fit(values: dict, computes: dict, arm: str, budgets: list[int], w: int) -> dict | None:
    """``gap = g C^-gamma`` over the trained budgets where the mean gap is positive (two at least)."""
    points = [(computes[(arm, b)], float((values[(arm, b)][:, w] - values[(FULL, b)][:, w]).mean()))
              for b in budgets if b > 0 and (arm, b) in values and (FULL, b) in values]
    points = [(c, g) for c, g in points if g > 0]
    if len(points) < 2:
        return None
    law = fit_power_law([c for c, _ in points], [g for _, g in points])
    return {"g": law.a, "exponent": law.b, "points": len(points)}


def retrieval_grids(evals: dict) -> list[dict]:
    grids = []
    for (arm, budget), records in sorted(evals.items()):
        cells: dict[tuple, list[bool]] = {}
        for r in records:
            if r["kind"] == "retrieval":
                cells.setdefault((r["length"], r["depth"]), []).append(r["answered"])
        if cells:
            grids.append({"arm": arm, "budget": budget, "cells": [{"length": n, "depth": d, "answered": sum(v),
                                                                    "trials": len(v)}
                                                                   for (n, d), v in sorted(cells.items())]})
    return grids


def parts_summary(settings: dict, parts: list[dict]) -> dict:
    planned = len(settings["arms"]) * (1 + len(settings["budgets"]))
    return {"done": sum(p["part"] == "eval" for p in parts), "planned": planned,
            "seconds": {kind: round(sum(p["seconds"] for p in parts if p["part"] == kind), 1)
                        for kind in ("trunk", "branch", "eval")},
            "steps_trained": sum(p["steps"] for p in parts if p["part"] != "eval")}


# -- writing ----------------------------------------------------------------------------------


def fmt(entry: dict, signed: bool = False) -> str:
    sign = "+" if signed else ""
    if entry["low"] is None:
        return f"{entry['mean']:{sign}.3f}"
    return f"{entry['mean']:{sign}.3f} [{entry['low']:{sign}.3f}, {entry['high']:{sign}.3f}]"


def label(arm: str) -> str:
    return Arm.parse(arm).label()


def markdown(settings: dict, summary: dict, machines: list[str]) -> str:
    parts, labels = summary["parts"], summary["windows"]
    data = settings["data"]["init_args"]
    done = {(r["arm"], r["budget"]) for r in summary["table"]}
    machine_text = "; ".join(machines) or "not recorded"
    status = ("complete" if parts["done"] == parts["planned"] else
              f"**PARTIAL: {parts['done']} of {parts['planned']} models scored; the study is still running, and every "
              "number below is from the parts finished so far**")
    lines = [
        "# Continued-training scaling: MoBA against full attention", "", f"Status: {status}.", "",
        f"From `{settings['model']['init_from']}`, budgets {settings['budgets']} optimizer steps of "
        f"{data['batch_size']} x {data['seq_len']} tokens (lr {settings['model']['lr']:g}, warmup "
        f"{settings['model']['warmup_steps']} steps, then constant; each budget decays linearly to "
        f"{settings['model']['min_lr_ratio']:g} x lr over its last {settings['decay_fraction']:.0%}, a branch of one "
        f"trunk per arm); scored at {settings['eval_seq_len']} tokens on {len(summary['documents'])} held-out "
        "documents (the test split of the training data), paired across arms and budgets. Budget 0 is the "
        "pretrained model, training-free.", "",
        f"Machine: {machine_text}. Wall time so far: training "
        f"{(parts['seconds']['trunk'] + parts['seconds']['branch']) / 3600:.2f} h ({parts['steps_trained']} steps), "
        f"evaluation {parts['seconds']['eval'] / 3600:.2f} h.", "",
        "Compute: tokens x (6 N + 3 x 4 H D x keys attended per query, summed over layers), N non-embedding "
        "parameters, in PFLOP/s-days.", "",
        "## Loss per window (nats/token, mean over documents, 95% t interval)", "",
        "| arm | steps | PFLOP/s-days | " + " | ".join(labels) + " |", "|---" * (len(labels) + 3) + "|"]
    for row in summary["table"]:
        lines.append(f"| {label(row['arm'])} | {row['budget']} | {row['compute_pflops_days']:.3g} | "
                     + " | ".join(fmt(x) for x in row["loss"]) + " |")
    lines += ["", "## Minus full attention at the same budget (paired by document)", "",
              "| arm | steps | " + " | ".join(labels) + " |", "|---" * (len(labels) + 2) + "|"]
    for row in summary["table"]:
        if "minus_full" in row:
            lines.append(f"| {label(row['arm'])} | {row['budget']} | "
                         + " | ".join(fmt(x, True) for x in row["minus_full"]) + " |")
    lines += ["", "## Projections", ""]
    if not summary["projections"]:
        lines.append("No arm has two trained budgets yet: no power law fitted.")
    else:
        fewest = min(len(p["budgets"]) for p in summary["projections"])
        if fewest == 2:
            lines += ["A fit through two budgets passes through both exactly: it shows a direction, not that the "
                      "loss follows a power law; the fits through three budgets or more have residuals to judge "
                      "them by.", ""]
        lines += ["| arm | window | budgets fitted | fit L = a C^b | gap fit (minus full) | meets full at "
                  "(PFLOP/s-days) | 95% interval (resampled documents) | share of resamples meeting |",
                  "|---|---|---|---|---|---|---|---|"]
        for p in summary["projections"]:
            gap = p.get("gap_fit")
            gap_text = f"{gap['g']:.3g} C^{gap['exponent']:.3f}" if gap else "—"
            meets = p.get("meets_full_at")
            boot = p.get("meeting_bootstrap") or {}
            interval = boot.get("interval")
            lines.append(f"| {label(p['arm'])} | {p['window']} | {', '.join(map(str, p['budgets']))} | "
                         f"{p['a']:.3f} C^{p['b']:.4f} | "
                         f"{gap_text if p['arm'] != FULL else ''} | "
                         f"{'' if p['arm'] == FULL else (f'{meets:.3g}' if meets else 'do not meet ahead')} | "
                         f"{f'{interval[0]:.3g} – {interval[1]:.3g}' if interval else ''} | "
                         f"{'' if p['arm'] == FULL else format(boot.get('share_meeting', 0), '.0%')} |")
    if summary["retrieval"]:
        lines += ["", "## Passkey retrieval (answered / trials; every arm the same keys)", ""]
        for grid in summary["retrieval"]:
            cells = ", ".join(f"{c['length']}@{c['depth']:.1f} {c['answered']}/{c['trials']}" for c in grid["cells"])
            lines.append(f"- {label(grid['arm'])}, {grid['budget']} steps: {cells}")
    missing = [f"{label(a)} {b}" for a in settings["arms"] for b in [0, *settings["budgets"]] if (a, b) not in done]
    if missing:
        lines += ["", "Not scored yet: " + ", ".join(missing) + "."]
    return "\n".join(lines) + "\n"


def arm_color(arms: list[str], arm: str) -> str:
    if arm == FULL:
        return COLORS[FULL]
    return MOBA_COLORS[[a for a in arms if a != FULL].index(arm) % len(MOBA_COLORS)]


def points_with_intervals(axis, rows: list[dict], key: str, w: int, color: str, name: str) -> list[float]:
    """``rows``' means of ``row[key][w]`` against their compute, with their 95% intervals; the compute."""
    x = [r["compute_pflops_days"] for r in rows]
    y = [r[key][w]["mean"] for r in rows]
    err = [[m - (r[key][w]["low"] or m) for r, m in zip(rows, y, strict=True)],
           [(r[key][w]["high"] or m) - m for r, m in zip(rows, y, strict=True)]]
    axis.errorbar(x, y, yerr=err, fmt="o", color=color, capsize=3, label=name)
    return x


def window_panels():
    """A figure of 2 x 2 panels, one per report window: ``(figure, [4] axes)``."""
    fig = figures.figure(10, 7.5)
    return fig, fig.subplots(2, 2).flatten()


def save_panels(fig, axes, used: int, legend_title: str, path: Path) -> None:
    """The first panel's legend (when it drew anything), the unused panels hidden, the figure written."""
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=8, title=legend_title, title_fontsize=7)
    for axis in axes[used:]:
        axis.set_visible(False)
    figures.save(fig, path)


def plot_loss(settings: dict, summary: dict, path: Path) -> None:
    arms, labels = settings["arms"], summary["windows"]
    fig, axes = window_panels()
    laws = {(p["arm"], p["window"]): p for p in summary["projections"]}
    for w, axis in enumerate(axes[: len(labels)]):
        for arm in arms:
            rows = [r for r in summary["table"] if r["arm"] == arm]
            trained = [r for r in rows if r["budget"] > 0]
            color = arm_color(arms, arm)
            if trained:
                x = points_with_intervals(axis, trained, "loss", w, color, label(arm))
            start = [r for r in rows if r["budget"] == 0]
            if start:
                axis.axhline(start[0]["loss"][w]["mean"], color=color, linestyle=":", linewidth=1)
            law = laws.get((arm, labels[w]))
            if law and trained:
                grid = np.geomspace(min(x) / 2, max(x) * 30, 50)
                axis.plot(grid, law["a"] * grid ** law["b"], "--", color=color, linewidth=1)
        axis.set(xscale="log", yscale="log", title=labels[w], xlabel="continued-training compute (PFLOP/s-days)",
                 ylabel="LM loss (nats/token)")
    save_panels(fig, axes, len(labels), "dotted: training-free; dashed: fit", path)


def plot_gap(settings: dict, summary: dict, path: Path) -> None:
    arms, labels = settings["arms"], summary["windows"]
    fig, axes = window_panels()
    gaps = {(p["arm"], p["window"]): p.get("gap_fit") for p in summary["projections"]}
    for w, axis in enumerate(axes[: len(labels)]):
        for arm in (a for a in arms if a != FULL):
            rows = [r for r in summary["table"] if r["arm"] == arm and r["budget"] > 0 and "minus_full" in r]
            if not rows:
                continue
            color = arm_color(arms, arm)
            x = points_with_intervals(axis, rows, "minus_full", w, color, label(arm))
            fit = gaps.get((arm, labels[w]))
            if fit:
                grid = np.geomspace(min(x) / 2, max(x) * 30, 50)
                axis.plot(grid, fit["g"] * grid ** fit["exponent"], "--", color=color, linewidth=1)
        axis.axhline(0, color="black", linewidth=0.5)
        axis.set(xscale="log", title=labels[w], xlabel="continued-training compute (PFLOP/s-days)",
                 ylabel="minus full attention (nats/token)")
    save_panels(fig, axes, len(labels), "dashed: gap fit g C^-γ", path)


def machines_of(records_dir: Path, parts: list[dict]) -> list[str]:
    """The machines the parts ran on: as the parts recorded them, else as their evaluations said."""
    said = {p.read_text().strip() for p in records_dir.glob("*/b*/eval/machine.txt")}
    return sorted({m.rstrip(".") for m in said | {p["machine"] for p in parts if p.get("machine")}})


def report(job: ReportJob) -> dict:
    study, out = Path(job.study), Path(job.out)
    settings, parts, evals = read_study(study)
    if out.exists() and not out.is_dir():
        raise UsageError("--out", f"{out} is a file, not a folder", "give a folder for the report")
    out.mkdir(parents=True, exist_ok=True)
    copy_records(study, out, parts)
    summary = summarize(settings, parts, evals)
    (out / "results.json").write_text(json.dumps(summary, indent=1, default=float) + "\n")
    (out / "results.md").write_text(markdown(settings, summary, machines_of(out / "records", parts)))
    plot_loss(settings, summary, out / "loss_vs_compute.png")
    plot_gap(settings, summary, out / "gap_vs_compute.png")
    return summary


def main(argv: list[str] | None = None) -> dict:
    job = parse_dataclass(ReportJob, sys.argv[1:] if argv is None else argv, prog="flexmoba continued-scaling-report",
                          description=__doc__)
    summary = report(job)
    parts = summary["parts"]
    print(f"continued-scaling-report: {parts['done']} of {parts['planned']} models scored on "
          f"{len(summary['documents'])} documents; see {Path(job.out) / 'results.md'}")
    return summary


