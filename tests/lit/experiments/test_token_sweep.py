"""The GPU token sweep: its --plan estimate, and its tiny CPU stand-in run end to end on tokens."""

import csv
import json
import math
import re
from pathlib import Path

import pytest
import yaml

from lit.experiments.sweep import SweepSpec
from lit.experiments.sweep import main as sweep_main

pytest.importorskip("tokenizers")

REPO = Path(__file__).resolve().parents[3]
GPU = REPO / "configs" / "sweep" / "tokens32k.yaml"
TINY = REPO / "configs" / "sweep" / "tokens32k_tiny.yaml"


def test_gpu_sweep_plan_is_a_32k_bf16_token_sweep_with_an_estimate(capsys):
    spec = SweepSpec.from_yaml(GPU)
    assert spec.seq_len == 32768 and "--trainer.precision=bf16-mixed" in spec.cli_args
    assert "--data=lit.training.tokenizer.TokenFilesData" in spec.cli_args
    assert len(spec.sizes) >= 4 and {kind.name for kind in spec.attention_kinds()} == {"moba", "full"}
    sweep_main([str(GPU), "--plan"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(spec.runs()) + 1
    total = re.fullmatch(r"estimated total: (\d+) min for 10 runs", lines[-1])
    assert total and 60 * 4 < int(total[1]) < 60 * 48  # hours, not minutes or weeks, on one GPU
    assert all("tokens/param" in line and line.endswith(" min") for line in lines[:-1])


def tiny_sweep_config(tmp_path: Path, corpus_cache: Path) -> Path:
    spec = yaml.safe_load(TINY.read_text())
    spec.update(out_dir=str(tmp_path / "sweep"), base_config=str(REPO / "configs" / "moba.yaml"))
    spec["cli_args"] += ["--data.cache_dir", str(corpus_cache)]
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.slow
def test_tiny_token_sweep_runs_end_to_end(tmp_path, corpus_cache, monkeypatch):
    monkeypatch.chdir(REPO)
    config = tiny_sweep_config(tmp_path, corpus_cache)
    sweep_main([str(config)])
    with open(tmp_path / "sweep" / "runs.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["run"] for r in rows) == sorted(run.name for run in SweepSpec.from_yaml(config).runs())
    for row in rows:
        result = json.loads((tmp_path / "sweep" / row["run"] / "result.json").read_text())
        metrics = result["metrics"]
        assert math.isfinite(metrics["val/bpb"]) and metrics["val/bpb"] < metrics["val/loss"] / math.log(2)
        assert "val/loss_pos_000120_000128" in metrics  # windows in tokens of a 128-token sequence
    (tokenizer,) = corpus_cache.glob("tokens-*.tokenizer.json")
    assert len(json.loads(tokenizer.read_text())["model"]["vocab"]) == 300
