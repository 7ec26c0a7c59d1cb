"""Long-context scaling pipeline: the 32K sweep's tiny stand-in run end to end, and the report's
verdict and intervals on fabricated results whose answers are known."""

import csv
import json
import math
from pathlib import Path

import pytest
import yaml

from lit.experiments.scaling_report import write_report
from lit.experiments.sweep import SweepSpec
from lit.experiments.sweep import main as sweep_main
from lit.training.data import ByteFilesData

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "configs" / "sweep" / "long32k_tiny.yaml"
WINDOW_14K, WINDOW_20K = "val/loss_pos_000112_000128", "val/loss_pos_000160_000176"  # of 256 bytes


def tiny_sweep_config(tmp_path: Path, corpus_cache: Path) -> Path:
    spec = yaml.safe_load(TINY.read_text())
    spec.update(out_dir=str(tmp_path / "sweep"), report_dir=str(tmp_path / "docs"),
                base_config=str(REPO / "configs" / "moba.yaml"))
    spec["cli_args"] += ["--data.cache_dir", str(corpus_cache)]
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_tiny_long_context_sweep_builds_the_report(tmp_path, corpus_cache, monkeypatch):
    monkeypatch.chdir(REPO)
    config = tiny_sweep_config(tmp_path, corpus_cache)
    sweep_main([str(config)])
    docs = tmp_path / "docs"
    with open(docs / "runs.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["run"] for r in rows) == sorted(run.name for run in SweepSpec.from_yaml(config).runs())
    assert {r["attention"] for r in rows} == {"moba", "full", "hybrid"} and {r["seed"] for r in rows} == {"0"}
    for column in ("val/bpb", "val/loss_trailing", WINDOW_14K, WINDOW_20K):
        assert all(math.isfinite(float(r[column])) for r in rows), column
    by_run = {r["run"]: r for r in rows}
    spent = [float(by_run[f"s2-{a}-seed0"]["compute_total"]) for a in ("moba", "hybrid", "full")]
    assert spent == sorted(spent) and len(set(spent)) == 3  # the hybrid pays full attention for its late steps
    report = (docs / "report.md").read_text()
    for text in ("moba vs full, positions 112-128", "moba vs full, positions 160-176", "moba vs full, trailing window",
                 "1.630·C^-0.089", "![gate diagnostics](gate_s2-moba-seed0.png)"):
        assert text in report, text
    for figure in ("scaling.png", "scaling_spent.png", "positions.png", "gate_s2-moba-seed0.png"):
        assert (docs / figure).stat().st_size > 10_000, figure
    hybrid = json.loads((tmp_path / "sweep" / "s2-hybrid-seed0" / "result.json").read_text())
    assert hybrid["switch_to_full_at"] == 0.5 and hybrid["seq_len"] == 256

    # Killed after its last checkpoint, before its result: the resumed fit has nothing left to train,
    # so the run is validated anew, and gives the numbers of the validation that ended its fit.
    result = tmp_path / "sweep" / "s1-full-seed0" / "result.json"
    ended_fit = json.loads(result.read_text())["metrics"]
    result.unlink()
    sweep_main([str(config)])
    validated = json.loads(result.read_text())
    assert validated["resumed"] and validated["metrics"].keys() >= ended_fit.keys()
    for key, value in ended_fit.items():
        assert validated["metrics"][key] == pytest.approx(value, rel=1e-5), key


def test_long32k_validates_on_held_out_documents_that_reach_32k(tmp_path):
    spec = SweepSpec.from_yaml(REPO / "configs" / "sweep" / "long32k.yaml")
    data_args = dict(arg[len("--data."):].split("=") for arg in spec.cli_args if arg.startswith("--data."))
    data = ByteFilesData(seq_len=spec.seq_len, min_document_bytes=int(data_args["min_document_bytes"]),
                         cache_dir=str(tmp_path))
    selected = data._selected_files()
    assert len(selected["val"]) >= 10 and len(selected["train"]) >= 100
    assert all(size > spec.seq_len for split in selected.values() for _, size in split)
    assert not {name for name, _ in selected["val"]} & {name for name, _ in selected["train"]}
    full_sequences = sum((size - 1) // spec.seq_len for _, size in selected["val"])  # as lit.training.data cuts them
    assert full_sequences >= spec.limit_val_batches * spec.batch_size  # validation never runs short


# -- the report on fabricated results ----------------------------------------------------

COMPUTE = [1e-4, 1e-3, 1e-2, 1e-1]
SEED_OFFSET = 0.002  # seed 0 at +0.002, seed 1 at -0.002: every seed standard deviation is 0.002 * sqrt(2)
FULL_NOISE = [1.01, 0.99, 1.0, 1.005]  # off the exact law, so that the fit has residuals
GAP_14K = [0.001] * 4  # MoBA within seed noise
GAP_20K = [0.08, 0.062, 0.038, 0.02]  # MoBA behind, the gap narrowing with compute
GAP_TRAILING = [0.03, 0.012, -0.01, -0.03]  # MoBA overtakes full attention inside the measured range


def full_loss(compute: float, i: int) -> float:
    return 1.6 * compute**-0.087 * FULL_NOISE[i]


def fabricate(folder: Path) -> None:
    for i, compute in enumerate(COMPUTE):
        for seed, offset in enumerate((SEED_OFFSET, -SEED_OFFSET)):
            for attention in ("moba", "full"):
                gaps = (GAP_14K[i], GAP_20K[i], GAP_TRAILING[i]) if attention == "moba" else (0, 0, 0)
                base = full_loss(compute, i) + offset
                metrics = {"val/loss": base, "val/bpb": base / math.log(2), WINDOW_14K: base + gaps[0],
                           WINDOW_20K: base + gaps[1], "val/loss_trailing": base + gaps[2]}
                run = f"s{i}-{attention}-seed{seed}"
                (folder / run).mkdir(parents=True)
                (folder / run / "result.json").write_text(json.dumps({
                    "run": run, "size": f"s{i}", "attention": attention, "seed": seed, "seq_len": 256,
                    "steps": 10, "seconds": 1.0, "params_non_embedding": 1000, "tokens": 10_000,
                    "compute_6nd": compute, "compute_total": compute * 1.5, "metrics": metrics}))


@pytest.fixture(scope="module")
def fabricated_report(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("fabricated")
    fabricate(folder)
    return write_report(folder, bootstrap=20).read_text()


def t_interval_of_b(compute: list[float], loss: list[float]) -> tuple[float, float, float]:
    """Least squares of log L on log C by hand: (b, low, high), t with n - 2 = 2 degrees of freedom."""
    x, y = [math.log(c) for c in compute], [math.log(v) for v in loss]
    mx, my = sum(x) / len(x), sum(y) / len(y)
    sxx = sum((xi - mx) ** 2 for xi in x)
    b = sum((xi - mx) * (yi - my) for xi, yi in zip(x, y, strict=True)) / sxx
    residual = sum((yi - my - b * (xi - mx)) ** 2 for xi, yi in zip(x, y, strict=True))
    half = 4.303 * math.sqrt(residual / (len(x) - 2) / sxx)
    return b, b - half, b + half


def report_row(report: str, label: str) -> str:
    return next(line for line in report.splitlines() if line.startswith(f"| {label} |"))


def test_laws_are_fitted_to_seed_means_with_t_intervals(fabricated_report):
    b, low, high = t_interval_of_b(COMPUTE, [full_loss(c, i) for i, c in enumerate(COMPUTE)])
    row = report_row(fabricated_report, "whole sequence")
    assert f"C^{b:.3f} (±" in row and f"95% t: [{low:.3f}, {high:.3f}]" in row


def test_verdict_tells_noise_from_a_gap(fabricated_report):
    half = 4.303 * math.sqrt(2 * (2 * SEED_OFFSET**2) / 2)  # t(2 dof) x stderr of a difference of two means
    assert f"within seed noise: +0.0010 nats, 95% t [{0.001 - half:+.4f}, {0.001 + half:+.4f}]" in fabricated_report
    assert f"moba behind: +0.0800 nats, 95% t [{0.08 - half:+.4f}, {0.08 + half:+.4f}]" in fabricated_report
    section = fabricated_report.split("**moba vs full, positions 160-176:**")[1].split("\n")[0]
    assert "the gap narrows with compute" in section
    section = fabricated_report.split("**moba vs full, positions 112-128:**")[1].split("\n")[0]
    assert "no significant trend" in section


def test_crossovers_say_measured_or_extrapolated(fabricated_report):
    assert "(within the measured range)" in report_row(fabricated_report, "trailing window")
    assert "(extrapolation)" in report_row(fabricated_report, "positions 160-176")
    paper = fabricated_report.split("## Beside the MoBA paper")[1]
    assert "1.546·C^-0.108 | 1.464·C^-0.097" in paper and "1.630·C^-0.089 | 1.600·C^-0.087" in paper
