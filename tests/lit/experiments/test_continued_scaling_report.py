"""``flexmoba continued-scaling-report``: its windows, means, fits and meeting points recomputed here from
records whose answer is known, and the committed report recomputed from its committed records."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("lightning")

from lit.experiments import continued_scaling_report as report  # noqa: E402
from lit.experiments.context_eval import Arm  # noqa: E402
from lit.experiments.continued_scaling import training_flops_per_token  # noqa: E402

COMMITTED = Path(__file__).parents[3] / "docs" / "pretrained" / "scaling"
SETTINGS = {
    "arms": ["full", "moba:64:2"], "budgets": [10, 20, 40], "decay_fraction": 0.2, "eval_seq_len": 1024,
    "eval_window": 64, "eval_trailing": 32, "model": {"init_from": "pretrained.ckpt", "lr": 1e-4, "warmup_steps": 2,
                                                        "min_lr_ratio": 0.1, "config": {
                                                            "n_layers": 2, "d_model": 64, "n_heads": 2,
                                                            "n_kv_heads": 1, "head_dim": 32,
                                                            "moba": {"chunk_size": 64, "top_k": 2}}},
    "data": {"init_args": {"seq_len": 512, "batch_size": 2}},
}
LAWS = {"full": (3.0, -0.05), "moba:64:2": (3.6, -0.08)}  # MoBA above, falling faster: they meet ahead
DOCUMENTS = 6


def compute(arm: str, budget: int) -> float:
    """PFLOP/s-days, from the FLOPs per token and the tokens, computed here."""
    return budget * 2 * 512 * training_flops_per_token(SETTINGS, Arm.parse(arm)) / (1e15 * 86400)


def write_study(folder: Path, noise: float) -> Path:
    """A finished study whose window losses follow LAWS exactly, plus per-document noise that averages out."""
    folder.mkdir(parents=True)
    (folder / "study.json").write_text(json.dumps(SETTINGS))
    parts, rng = [], np.random.default_rng(0)
    offsets = rng.normal(0, noise, DOCUMENTS)
    offsets -= offsets.mean()
    for arm in SETTINGS["arms"]:
        for budget in [0, *SETTINGS["budgets"]]:
            a, b = LAWS[arm]
            level = a * compute(arm, budget) ** b if budget else a * 1.5
            lines = []
            for d in range(DOCUMENTS):
                windows = [level + offsets[d] + 0.01 * i for i in range(16)]  # rising along the document
                lines.append({"kind": "position", "arm": arm, "document": f"doc{d}", "windows": windows,
                              "trailing": level + offsets[d], "mean": float(np.mean(windows))})
            path = report.eval_records_path(folder, arm, budget)
            path.parent.mkdir(parents=True)
            path.write_text("".join(json.dumps(r) + "\n" for r in lines))
            parts.append({"part": "eval", "arm": arm, "budget": budget, "seconds": 1.0, "steps": 0})
    (folder / "study.jsonl").write_text("".join(json.dumps(p) + "\n" for p in parts))
    return folder


def test_the_reference_windows_sit_at_the_reference_figures_relative_positions():
    spans = report.window_spans({"eval_window": 512, "eval_seq_len": 8192})
    assert [(first * 512, end * 512) for _, first, end in spans] == [(3584, 4096), (5120, 5632), (7168, 8192)]
    assert [name.split(" ")[0] for name, _, _ in spans] == ["3.5K–4K", "5K–5.5K", "7K–8K"]


def test_means_fits_and_the_meeting_point_are_the_ones_the_records_hold(tmp_path):
    study = write_study(tmp_path / "study", noise=0.05)
    summary = report.report(report.ReportJob(str(study), str(tmp_path / "out")))
    rows = {(r["arm"], r["budget"]): r for r in summary["table"]}
    # window 14-16K of 32K at 1024/64 = scored windows 7 (mean of one), level + 0.07
    for arm in LAWS:
        for budget in SETTINGS["budgets"]:
            a, b = LAWS[arm]
            assert rows[(arm, budget)]["loss"][0]["mean"] == pytest.approx(a * compute(arm, budget) ** b + 0.07)
            assert rows[(arm, budget)]["loss"][2]["mean"] == pytest.approx(a * compute(arm, budget) ** b + 0.145)
            assert rows[(arm, budget)]["compute_pflops_days"] == pytest.approx(compute(arm, budget))
    # the trailing window is offset-free: the fit recovers the law, the meeting point its crossing
    fits = {(p["arm"], p["window"]): p for p in summary["projections"]}
    trailing = summary["windows"][-1]
    for arm, (a, b) in LAWS.items():
        assert fits[(arm, trailing)]["a"] == pytest.approx(a, rel=1e-6)
        assert fits[(arm, trailing)]["b"] == pytest.approx(b, rel=1e-6)
    (a_f, b_f), (a_m, b_m) = LAWS["full"], LAWS["moba:64:2"]
    assert fits[("moba:64:2", trailing)]["meets_full_at"] == pytest.approx(math.exp(math.log(a_f / a_m) / (b_m - b_f)),
                                                                           rel=1e-4)
    # paired differences: the documents' offsets cancel exactly
    gap = rows[("moba:64:2", 20)]["minus_full"][-1]
    expected = a_m * compute("moba:64:2", 20) ** b_m - a_f * compute("full", 20) ** b_f
    assert gap["mean"] == pytest.approx(expected) and gap["high"] - gap["low"] == pytest.approx(0, abs=1e-9)
    assert (tmp_path / "out" / "loss_vs_compute.png").stat().st_size > 0
    assert "Status: complete." in (tmp_path / "out" / "results.md").read_text()


def test_a_partial_study_says_so_and_names_what_is_not_scored(tmp_path):
    study = write_study(tmp_path / "study", noise=0.05)
    parts = (study / "study.jsonl").read_text().splitlines()
    (study / "study.jsonl").write_text("\n".join(p for p in parts if '"budget": 40' not in p) + "\n")
    report.report(report.ReportJob(str(study), str(tmp_path / "out")))
    text = (tmp_path / "out" / "results.md").read_text()
    assert "PARTIAL: 6 of 8 models scored" in text
    assert "Not scored yet: full attention 40, MoBA 64/2 40." in text
    assert "A fit through two budgets passes through both exactly" in text  # 10 and 20 only
    assert "| MoBA 64/2 | " in text and "| 10, 20 | " in text
    whole = report.report(report.ReportJob(str(write_study(tmp_path / "whole", noise=0.05)), str(tmp_path / "w")))
    assert {tuple(p["budgets"]) for p in whole["projections"]} == {(10, 20, 40)}
    assert "passes through both exactly" not in (tmp_path / "w" / "results.md").read_text()


def test_the_committed_report_is_the_one_its_committed_records_give(tmp_path):
    assert (COMMITTED / "records" / "study.json").is_file(), "docs/pretrained/scaling/records is the report's source"
    report.report(report.ReportJob(str(COMMITTED / "records"), str(tmp_path)))
    assert (tmp_path / "results.md").read_text() == (COMMITTED / "results.md").read_text()
    # the fits' last bits follow the BLAS (its thread count, the CPU): the JSON's numbers agree to 1e-9 relative
    made = json.loads((tmp_path / "results.json").read_text())
    assert differences(made, json.loads((COMMITTED / "results.json").read_text())) == []


def differences(made, committed, at: str = "") -> list[str]:
    """Where two JSON values differ: in structure, in a string, or in a number by more than 1e-9 relative."""
    if isinstance(made, dict) and isinstance(committed, dict):
        if made.keys() != committed.keys():
            return [f"{at}: keys {sorted(made)} != {sorted(committed)}"]
        return [d for k in made for d in differences(made[k], committed[k], f"{at}.{k}")]
    if isinstance(made, list) and isinstance(committed, list):
        if len(made) != len(committed):
            return [f"{at}: {len(made)} items != {len(committed)}"]
        pairs = enumerate(zip(made, committed, strict=True))
        return [d for i, (a, b) in pairs for d in differences(a, b, f"{at}[{i}]")]
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (made, committed))
    if numbers and math.isclose(made, committed, rel_tol=1e-9, abs_tol=1e-15):
        return []
    return [] if made == committed else [f"{at}: {made!r} != {committed!r}"]
