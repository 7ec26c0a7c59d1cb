"""Main job: train MoBA and full attention on the same budget and compare them.

    flexmoba compare                                  # the default budget, minutes on 2 CPU cores
    flexmoba compare --seeds 3 --out runs/compare-3seeds   # three seeds per attention kind: mean ± std
    flexmoba compare --trainer.max_steps 2 --data.max_files 5 --data.seq_len 128 --out /tmp/cmp   # smoke run
    flexmoba compare --model.config.moba.top_k 2 --model.config.d_model 256 --out runs/compare-top2   # any fit option

It takes every option of ``flexmoba fit`` with the same spelling (``--config`` files too) and
three of its own: ``--seeds`` (runs per attention kind, seeded ``seed_everything + i``; the
data order stays the first seed's), ``--out`` (the study's folder) and ``--final_val_batches``.
Both kinds share the data, seeds, model size and schedule; only ``model.config.attention``
differs. Runs go seed by seed, MoBA then full attention, so the two runs of a seed are adjacent
in time. Every run goes through the one launcher (:mod:`lit.training.launch`), so a run that
diverges stops the study with one line, and checkpoints are atomic.

``<out>/`` holds ``compare.json`` (the study's settings), one run per kind and seed in
``<attention>/seed<N>/`` (its checkpoints, CSV and TensorBoard logs, ``result.json`` once
finished), and the report: ``results.md`` (mean ± std over seeds), ``results.json``,
``val_loss.png`` and ``loss_by_position.png``. Started again with the same arguments,
compare skips finished runs and resumes an interrupted one from its last checkpoint; an
``--out`` that holds a study with other settings is refused.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
from pathlib import Path

import torch
from jsonargparse import DefaultHelpFormatter

from flexmoba.model import ModelConfig
from lit.training import figures
from lit.training import metric_names as names
from lit.training.errors import UsageError
from lit.training.launch import fit_and_validate, read_config
from lit.training.progress import StartLines, moba_note, plural, say
from lit.training.statistics import mean_std

VARIANTS = ("moba", "full")
PROG = "flexmoba compare"

# The main job's budget (the recipe, optimizer, clipping and log cadence, is fit's own). Left None:
# warmup a tenth of the steps, a validation every fifth.
BUDGET = {
    "trainer.max_steps": 100,
    "trainer.limit_val_batches": 8,
    "trainer.num_sanity_val_steps": 0,
    "trainer.enable_model_summary": False,
    "checkpoint.every_n_train_steps": 20,
    "model.warmup_steps": None,
    "model.position_window": None,
    "model.trailing_window": None,
    "data": {"class_path": "lit.training.data.ByteFilesData", "init_args": {"seed": 1337}},
}


def compare_arguments(parser) -> None:
    parser.add_argument("--seeds", type=int, default=1, help="runs per attention kind (seed_everything + i)")
    parser.add_argument("--out", type=str, default="runs/compare", help="the study's folder")
    parser.add_argument("--final_val_batches", type=int, default=32, help="batches of each run's final validation")


def parse(argv: list[str]) -> dict:
    """The study's settings: a ``flexmoba fit`` config plus ``seeds``, ``out``, ``final_val_batches``."""
    study = read_config(argv, compare_arguments, BUDGET, complete_budget, prog=PROG, description=__doc__,
                        formatter_class=ExamplesKeptFormatter)
    study["model"]["config"] = study["model"]["config"] or dataclasses.asdict(ModelConfig())  # the default model
    return study


class ExamplesKeptFormatter(argparse.RawDescriptionHelpFormatter, DefaultHelpFormatter):
    """jsonargparse's help (types, defaults) with the description's example lines kept as written."""


def complete_budget(config) -> None:
    """Values left None that follow the budget: warmup a tenth of the steps, a validation every fifth,
    position windows a quarter of the sequence, bf16 on a GPU."""
    for name in ("seeds", "final_val_batches"):
        if config[name] < 1:
            raise UsageError(f"--{name}", f"must be a positive int, got {config[name]}")
    trainer, model, data = config.trainer, config.model, config.data.init_args
    attention = (model.config or {}).get("attention", "moba")
    if attention != "moba":
        raise UsageError("--model.config.attention", f"compare trains both kinds (moba and full), got {attention!r}",
                         "drop it, or train one kind with flexmoba fit")
    steps = trainer.max_steps
    if not isinstance(steps, int) or steps < 1:
        raise UsageError("--trainer.max_steps", f"must be a positive int, got {steps!r}")
    trainer.val_check_interval = trainer.val_check_interval or min(steps, max(1, steps // 5))
    trainer.check_val_every_n_epoch = None
    model.warmup_steps = max(1, steps // 10) if model.warmup_steps is None else model.warmup_steps
    window = max(1, data.seq_len // 4)
    model.position_window = window if model.position_window is None else model.position_window
    model.trailing_window = model.position_window if model.trailing_window is None else model.trailing_window
    if trainer.precision is None:
        on_cuda = trainer.accelerator in ("auto", "cuda", "gpu") and torch.cuda.is_available()
        trainer.precision = "bf16-mixed" if on_cuda else "32-true"


def run_config(study: dict, attention: str, seed: int) -> dict:
    """The ``flexmoba fit`` config of one run of the study."""
    config = {k: v for k, v in study.items() if k not in ("seeds", "out", "final_val_batches")}
    config = json.loads(json.dumps(config))  # a deep copy of plain data
    config["model"]["config"]["attention"] = attention
    config["seed_everything"] = seed
    config["trainer"]["default_root_dir"] = str(run_folder(study, attention, seed))
    return config


def run_folder(study: dict, attention: str, seed: int) -> Path:
    return Path(study["out"]) / attention / f"seed{seed}"


def seeds_of(study: dict) -> list[int]:
    return [study["seed_everything"] + i for i in range(study["seeds"])]


def run_order(study: dict) -> list[tuple[str, int]]:
    """``(attention, seed)`` in training order: each seed's kinds back to back, so a machine whose
    speed drifts during the study moves both sides of each pair alike."""
    return [(attention, seed) for seed in seeds_of(study) for attention in VARIANTS]


def claim_folder(study: dict) -> None:
    """Record the study's settings in ``<out>/compare.json``, or refuse an ``--out`` holding another study."""
    out = Path(study["out"])
    settings = out / "compare.json"
    recorded = study
    if settings.exists():
        if json.loads(settings.read_text()) != json.loads(json.dumps(recorded)):
            raise UsageError("--out", f"{out} holds a compare study with other settings",
                             "give another --out, or the same arguments to resume it")
        return
    if out.exists() and not out.is_dir():
        raise UsageError("--out", f"{out} is a file, not a folder", "give a folder for the study")
    if out.exists() and any(out.iterdir()):
        raise UsageError("--out", f"{out} exists and is not a compare study's folder", "give another --out")
    out.mkdir(parents=True, exist_ok=True)
    settings.write_text(json.dumps(recorded, indent=2))


def read_csv_rows(run_dir: Path) -> list[dict[str, str]]:
    rows = []
    for path in sorted((run_dir / "csv").glob("version_*/metrics.csv")):
        with path.open() as f:
            rows += list(csv.DictReader(f))
    return rows


def val_history(rows: list[dict[str, str]], max_steps: int) -> list[tuple[int, float]]:
    """``(step, val/loss)`` of every validation during the fit, once per step. Lightning logs those at
    the step index before the optimizer step count, and the final validation after the fit at
    ``max_steps``: it is left out."""
    key = names.loss("val")
    history = {int(r["step"]) + 1: float(r[key]) for r in rows if r.get(key)}
    return sorted((step, loss) for step, loss in history.items() if step <= max_steps)


def validation_count_keys() -> dict[str, str]:
    """``{"batches": "val/batches", ...}``: the logged names of what a validation read."""
    return {what: names.eval_count("val", what) for what in names.EVAL_COUNTS}


def fit_validation_counts(rows: list[dict[str, str]], max_steps: int) -> dict[str, int] | None:
    """What the last validation during the fit read (batches, sequences, tokens: the points of val_loss.png),
    or None when the logs hold no counts (a run of an earlier version)."""
    keys = validation_count_keys()
    during = [r for r in rows if all(r.get(key) for key in keys.values()) and int(r["step"]) + 1 <= max_steps]
    return {what: int(float(during[-1][key])) for what, key in keys.items()} if during else None


def split_counts(final: dict) -> tuple[dict, dict[str, int] | None]:
    """The final metrics without the counts of what the validation read, and those counts."""
    keys = validation_count_keys()
    if not all(key in final for key in keys.values()):
        return final, None
    counts = {what: int(final[key]) for what, key in keys.items()}
    return {k: v for k, v in final.items() if k not in keys.values()}, counts


def throughput(rows: list[dict[str, str]]) -> tuple[float, int]:
    """Training seconds (validation excluded) and tokens, summed over the fit's sessions (a resumed
    run restarts the clock), from the throughput monitor's cumulative counters."""
    seconds, tokens = names.throughput("train", "time"), names.throughput("train", "lengths")
    counters = [(float(r[seconds]), int(float(r[tokens]))) for r in rows if r.get(seconds) and r.get(tokens)]
    session_ends = [c for c, after in zip(counters, [*counters[1:], None], strict=False)
                    if after is None or after[0] < c[0]]
    return sum(t for t, _ in session_ends), sum(n for _, n in session_ends)


def train_one(study: dict, attention: str, seed: int, announce: bool = False) -> dict:
    """Fit (or resume) one run and validate it; its ``result.json`` marks it finished. With ``announce``
    the run says what data it reads when it starts (the study's first run to train does)."""
    folder = run_folder(study, attention, seed)
    done = folder / "result.json"
    if done.exists():
        print(f"[compare] {attention} (seed {seed}): done, skipped", flush=True)
        return json.loads(done.read_text())
    resume = any((folder / "checkpoints").glob("*.ckpt"))  # killed between step and last checkpoint: resumes too
    print(f"[compare] {attention} (seed {seed}): {'resuming' if resume else 'training'} -> {folder}", flush=True)
    load_before = os.getloadavg()[0]
    cli, final = fit_and_validate(run_config(study, attention, seed), resume=resume,
                                  limit_val_batches=study["final_val_batches"],
                                  start=StartLines(data=True, moba=False) if announce else None)
    final, counts = split_counts(final)
    config: ModelConfig = cli.model.config
    seq_len = cli.model.seq_len
    rows = read_csv_rows(folder)
    seconds, tokens = throughput(rows)
    result = {
        "attention": attention,
        "seed": seed,
        "config": json.loads(json.dumps(cli.model.hparams["config"])),
        "final": final,
        "final_validation": counts,
        "val_history": val_history(rows, study["trainer"]["max_steps"]),
        "validation_during_fit": fit_validation_counts(rows, study["trainer"]["max_steps"]),
        "windows": [list(w) for w in cli.model.windows],
        "params_non_embedding": config.num_parameters(non_embedding=True),
        "params_total": config.num_parameters(non_embedding=False),
        "train_seconds": seconds,
        "train_tokens": tokens,
        "tokens_per_second": tokens / max(seconds, 1e-9),
        "load_average": [load_before, os.getloadavg()[0]],  # 1-minute, at its start and end
        "cpus": os.cpu_count(),
        "dense_flops_per_token": config.dense_flops_per_token(),
        "attention_flops_per_token": config.attention_flops_per_token(seq_len),
        "checkpoint": str(folder / "checkpoints" / "last.ckpt"),
        "fingerprint": getattr(cli.datamodule, "fingerprint", None),
    }
    done.write_text(json.dumps(result, indent=2))
    return result


def window_losses(result: dict) -> list[float]:
    final = result["final"]
    return [final.get(names.position_loss("val", start, end), float("nan")) for start, end in result["windows"]]


def fmt(values: list[float], spec: str) -> str:
    mean, std = mean_std(values)
    return f"{mean:{spec}}" if std is None else f"{mean:{spec}} ± {std:{spec}}"


def by_attention(results: list[dict]) -> dict[str, list[dict]]:
    grouped: dict[str, list[dict]] = {}
    for r in results:
        grouped.setdefault(r["attention"], []).append(r)
    return grouped


def markdown_report(study: dict, results: list[dict]) -> str:
    moba = ModelConfig(**{**study["model"]["config"], "attention": "moba"})
    trainer, data = study["trainer"], study["data"].get("init_args", study["data"])
    seq_len, seeds = data["seq_len"], seeds_of(study)
    seed_text = f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {seeds[0]}-{seeds[-1]} (mean ± sample std)"
    lines = [
        "# MoBA vs full attention",
        "",
        f"Same budget for both: {trainer['max_steps']} steps x {data['batch_size']} sequences x {seq_len} bytes, "
        f"{seed_text}; corpus fingerprint `{results[0].get('fingerprint')}`.",
        f"MoBA: chunk {moba.moba.chunk_size}, top-k {moba.moba.top_k} "
        f"(skips {moba.attention_sparsity(seq_len):.0%} of causal query-key pairs at this length).",
        *([f"**Note:** {note.removeprefix('note: ')}: the moba row is full attention here."]
          if (note := moba_note(moba, seq_len)) else []),
        "",
        "| attention | val loss | val bpb | val ppl | trailing loss | params (non-emb) | train time (s) | tokens/s "
        "| 6N FLOPs/token | attention FLOPs/token |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for attention, runs in by_attention(results).items():
        def final(key, runs=runs):
            return [r["final"].get(key, float("nan")) for r in runs]
        first = runs[0]
        lines.append(
            f"| {attention} | {fmt(final(names.loss('val')), '.4f')} | {fmt(final(names.bits_per_byte('val')), '.4f')} "
            f"| {fmt(final(names.perplexity('val')), '.2f')} | {fmt(final(names.trailing_loss('val')), '.4f')} "
            f"| {first['params_non_embedding']:,} | {fmt([r['train_seconds'] for r in runs], '.2f')} "
            f"| {fmt([r['tokens_per_second'] for r in runs], ',.0f')} | {first['dense_flops_per_token']:.3g} "
            f"| {first['attention_flops_per_token']:.3g} |"
        )
    windows = results[0]["windows"]
    lines += ["", "Validation loss by target position window:", "",
              "| attention | " + " | ".join(f"{s}-{e}" for s, e in windows) + " |",
              "|---|" + "---|" * len(windows)]
    for attention, runs in by_attention(results).items():
        per_window = zip(*(window_losses(r) for r in runs), strict=True)
        lines.append(f"| {attention} | " + " | ".join(fmt(list(w), ".4f") for w in per_window) + " |")
    final, during = counts_text(results, "final_validation"), counts_text(results, "validation_during_fit")
    batches = {(r.get("final_validation") or {}).get("batches") for r in results}
    fewer = (f" (all the validation split holds: fewer than --final_val_batches {study['final_val_batches']})"
             if batches and all(b is not None and b < study["final_val_batches"] for b in batches) else "")
    differs = " (so its last point differs from the table)" if final != during else ""
    lines += ["", f"Final validation read {final} per run{fewer}; the curve in val_loss.png, {during} per "
              f"point{differs}. Trailing loss = the last window of positions; bpb = bits per byte. Train time counts "
              "training batches only (no validation); a resumed run's time is the sum of its sessions. "
              + speed_note(results), ""]
    return "\n".join(lines)


def speed_note(results: list[dict]) -> str:
    """What the time columns are worth: the machine's load while the runs trained, and where speed is measured."""
    loads = [load for r in results for load in r.get("load_average") or []]
    measured = "flexmoba bench train_step measures speed (both kinds in one process, repeated)"
    if not loads:
        return f"The machine's load was not recorded: the time columns are no speed measurement; {measured}."
    cpus = max(r.get("cpus") or 1 for r in results)
    shared = max(loads) > cpus + 0.5  # a run's own threads load the machine up to its cores
    state = "shared with other work" if shared else "not otherwise busy"
    return (f"1-minute load average {min(loads):.1f}-{max(loads):.1f} on {cpus} CPUs at the runs' starts and ends "
            f"({state}): the time columns are {'no' if shared else 'one run per seed, not a'} speed measurement; "
            f"{measured}.")


def counts_text(results: list[dict], key: str) -> str:
    """``1 batch, 3 sequences, 384 tokens``: what the runs' validation ``key`` read, as they recorded it (each
    run's when they differ)."""
    def one(counts: dict | None) -> str:
        if not counts:
            return "an uncounted number of batches"
        return ", ".join(plural(counts[what], word) for what, word in zip(names.EVAL_COUNTS,
                                                                         ("batch", "sequence", "token"), strict=True))

    texts = {f"{r['attention']} seed {r['seed']}": one(r.get(key)) for r in results}
    if len(set(texts.values())) == 1:
        return next(iter(texts.values()))
    return "; ".join(f"{run}: {text}" for run, text in texts.items())


def plot_mean_and_std(results: list[dict], x_of, losses_of, labels: dict, path: Path) -> None:
    """One line per attention kind: the seed mean of ``losses_of(run)`` at ``x_of(run)``, seed std as error bars."""
    fig = figures.figure(6, 4)
    ax = fig.subplots()
    for attention, runs in by_attention(results).items():
        stats = [mean_std(list(values)) for values in zip(*(losses_of(r) for r in runs), strict=True)]
        ax.errorbar(x_of(runs[0]), [m for m, _ in stats], yerr=[s or 0.0 for _, s in stats], marker="o", capsize=3,
                    label=attention)
    ax.set(ylabel="validation loss (nats/byte)", **labels)
    ax.legend()
    figures.save(fig, path, dpi=120)


def plot(results: list[dict], out: Path) -> None:
    plot_mean_and_std(results, lambda r: [s for s, _ in r["val_history"]], lambda r: [v for _, v in r["val_history"]],
                      {"xlabel": "step", "title": "Validation loss during training"}, out / "val_loss.png")
    plot_mean_and_std(results, lambda r: [(s + e) / 2 for s, e in r["windows"]], window_losses,
                      {"xlabel": "target position (window center)", "title": "Loss by position"},
                      out / "loss_by_position.png")


def run(study: dict) -> Path:
    """Train (or resume) every (attention, seed) run of the study and write the report; return its folder."""
    claim_folder(study)
    out = Path(study["out"])
    print(f"[compare] results go to {out}", flush=True)
    note = study_moba_note(study)
    if note:
        say(note)
    results, announced = [], False
    for attention, seed in run_order(study):
        trains = not (run_folder(study, attention, seed) / "result.json").exists()
        results.append(train_one(study, attention, seed, announce=trains and not announced))
        announced = announced or trains
    (out / "results.json").write_text(json.dumps({"study": study, "results": results}, indent=2))
    report = markdown_report(study, results)
    (out / "results.md").write_text(report)
    plot(results, out)
    print(report)
    print(summary_line(study, results), flush=True)
    return out


def study_moba_note(study: dict) -> str | None:
    """:func:`lit.training.progress.moba_note` for the study's MoBA runs."""
    data = study["data"].get("init_args", study["data"])
    return moba_note(ModelConfig(**{**study["model"]["config"], "attention": "moba"}), data["seq_len"])


def summary_line(study: dict, results: list[dict]) -> str:
    """The line the study ends with: each kind's final validation loss, where the report, checkpoints and logs are."""
    out = Path(study["out"])
    losses = ", ".join(f"{attention} {fmt([r['final'][names.loss('val')] for r in runs], '.4f')}"
                       for attention, runs in by_attention(results).items())
    read = counts_text(results, "final_validation")
    return (f"flexmoba: compare done: {names.loss('val')} {losses} ({read}); report "
            f"{out / 'results.md'} (plots beside it); checkpoints {out}/<attention>/seed<N>/checkpoints/last.ckpt; "
            f"logs {out}/<attention>/seed<N>/csv, tb")


def main(argv: list[str] | None = None) -> Path:
    import sys

    return run(parse(sys.argv[1:] if argv is None else list(argv)))
