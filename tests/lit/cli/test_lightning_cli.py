"""The ``flexmoba`` CLI end to end, in subprocesses (Lightning DDP re-launches its own command)."""

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lit.training.launch import run_cli

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
MAIN_CONFIGS = ["moba.yaml", "full.yaml", "hybrid.yaml", "hybrid_phase.yaml"]
DDP = ["--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu"]


def tiny_args(config: str, root, cache, *extra: str) -> list[str]:
    return ["--config", str(CONFIGS / config), "--config", str(CONFIGS / "tiny.yaml"),
            "--trainer.default_root_dir", str(root), "--data.cache_dir", str(cache),
            "--trainer.enable_progress_bar", "false", *extra]


def eval_metrics(root, prefix: str) -> dict[str, float]:
    """Metrics the newest CSVLogger version under ``root`` holds (what validate/test just logged)."""
    newest = max((root / "csv").glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    with open(newest / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    return {k: float(v) for row in rows for k, v in row.items() if k.startswith(prefix) and v}


@pytest.mark.parametrize("config", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_config_parses(config, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["flexmoba"])
    assert isinstance(yaml.safe_load((CONFIGS / config).read_text()), dict)
    configs = [CONFIGS / config] if config == "tiny.yaml" else [CONFIGS / config, CONFIGS / "tiny.yaml"]
    args = ["fit", *[a for c in configs for a in ("--config", str(c))], "--print_config"]
    with pytest.raises(SystemExit) as exit_info:  # --print_config validates against the classes, then exits
        run_cli(args)
    assert exit_info.value.code in (0, None)


@pytest.mark.slow
@pytest.mark.parametrize("config", MAIN_CONFIGS)
def test_fit_then_validate_from_checkpoint(config, tmp_path, corpus_cache, flexmoba, metrics_of):
    flexmoba("fit", *tiny_args(config, tmp_path, corpus_cache), cwd=tmp_path)
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()
    rows = metrics_of(tmp_path)
    assert any(r.get("val/loss") for r in rows) and any(r.get("train/loss") for r in rows)
    assert list((tmp_path / "tb").glob("version_*/events.out.tfevents.*"))
    flexmoba("validate", *tiny_args(config, tmp_path, corpus_cache), "--ckpt_path", "last", cwd=tmp_path)
    metrics = eval_metrics(tmp_path, "val/")
    assert {"val/loss", "val/ppl", "val/loss_trailing", "val/loss_pos_000000_000032"} <= set(metrics)
    # Uniform guessing (an untrained model) costs ln 256 = 5.55; these 6 steps reach about 5.04.
    assert 0 < metrics["val/loss"] < math.log(256) - 0.3
    if config == "hybrid_phase.yaml":
        moba_layers = [float(r["train/moba_layers"]) for r in rows if r.get("train/moba_layers")]
        assert moba_layers[0] == 2 and moba_layers[-1] == 0


@pytest.mark.slow
@pytest.mark.parametrize("stop_at", [4, 6])
def test_resume_matches_uninterrupted_run(stop_at, tmp_path, corpus_cache, flexmoba, metrics_of):
    """Stop at step ``stop_at`` of 8 (same LR schedule), resume from last.ckpt: same losses as one run.

    Epochs are cut to 3 batches, so step 4 is mid-epoch, step 6 an epoch end, and the
    resumed run crosses epoch boundaries (new shuffles).
    """
    common = ["--checkpoint.every_n_train_steps", "2", "--trainer.val_check_interval", "4",
              "--trainer.limit_train_batches", "3"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    flexmoba("fit", *tiny_args("moba.yaml", straight, corpus_cache), *common, "--trainer.max_steps", "8",
                 cwd=tmp_path)
    flexmoba("fit", *tiny_args("moba.yaml", split, corpus_cache), *common, "--trainer.max_steps", str(stop_at),
                 "--model.lr_decay_steps", "8", cwd=tmp_path)
    assert (split / "checkpoints" / f"step{stop_at:06d}.ckpt").exists()
    flexmoba("fit", *tiny_args("moba.yaml", split, corpus_cache), *common, "--trainer.max_steps", "8",
                 "--ckpt_path", "last", cwd=tmp_path)

    def train_losses(root):
        return {int(r["step"]): float(r["train/loss"]) for r in metrics_of(root) if r.get("train/loss")}

    with open(split / "csv" / "version_1" / "metrics.csv") as f:
        first_resumed = min(int(r["step"]) for r in csv.DictReader(f) if r.get("train/loss"))
    assert first_resumed == stop_at  # it really resumed from the stop, not from scratch
    expected, resumed = train_losses(straight), train_losses(split)
    assert sorted(expected) == sorted(resumed) == list(range(8))
    for step in range(8):
        assert resumed[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-6), step


@pytest.mark.slow
def test_ddp_fit_and_window_metrics_match_single_process(tmp_path, corpus_cache, flexmoba, metrics_of):
    flexmoba("fit", *tiny_args("moba.yaml", tmp_path, corpus_cache), *DDP, cwd=tmp_path)
    every_batch = ["--trainer.limit_val_batches", "1.0", "--ckpt_path", "last"]
    flexmoba("validate", *tiny_args("moba.yaml", tmp_path, corpus_cache), *every_batch, cwd=tmp_path)
    single = eval_metrics(tmp_path, "val/")
    flexmoba("validate", *tiny_args("moba.yaml", tmp_path, corpus_cache), *every_batch, *DDP, cwd=tmp_path)
    ddp = eval_metrics(tmp_path, "val/")
    assert len(single) >= 6 and set(single) == set(ddp)
    # every sequence and token read once; the batches are each process's, summed (each reads half, in its own)
    assert ddp["val/batches"] >= single["val/batches"] and single["val/sequences"] > 0
    for name, value in single.items():
        if name != "val/batches":
            assert ddp[name] == pytest.approx(value, rel=1e-5), name


@pytest.mark.slow
def test_test_and_predict_subcommands(tmp_path, corpus_cache, flexmoba, metrics_of):
    flexmoba("fit", *tiny_args("full.yaml", tmp_path, corpus_cache), "--trainer.max_steps", "2", cwd=tmp_path)
    flexmoba("test", *tiny_args("full.yaml", tmp_path, corpus_cache), "--ckpt_path", "last", cwd=tmp_path)
    assert {"test/loss", "test/ppl", "test/loss_trailing"} <= set(eval_metrics(tmp_path, "test/"))
    flexmoba("predict", *tiny_args("full.yaml", tmp_path, corpus_cache), "--ckpt_path", "last",
                 "--trainer.limit_predict_batches", "1", cwd=tmp_path)
    (written,) = (tmp_path / "predictions").glob("predictions-rank0.jsonl")
    records = [json.loads(line) for line in written.read_text().splitlines()]
    assert len(records) == 4  # one batch of the tiny config's 4 sequences
    assert all(0 < r["loss"] < math.log(256) + 1 and len(r["continuation_bytes"]) == 16 for r in records)


@pytest.mark.slow
def test_user_loggers_join_csv_and_tensorboard_unless_turned_off(tmp_path, corpus_cache, flexmoba):
    mine = json.dumps({"class_path": "lightning.pytorch.loggers.CSVLogger",
                       "init_args": {"save_dir": str(tmp_path / "mine"), "name": "stand_in_for_wandb"}})
    both, alone = tmp_path / "both", tmp_path / "alone"
    flexmoba("fit", *tiny_args("full.yaml", both, corpus_cache), "--trainer.max_steps", "2",
             "--trainer.logger", mine, cwd=tmp_path)
    assert list((both / "csv").glob("version_*/metrics.csv")) and list((both / "tb").glob("version_*/events*"))
    assert list((tmp_path / "mine" / "stand_in_for_wandb").glob("version_*/metrics.csv"))
    flexmoba("fit", *tiny_args("full.yaml", alone, corpus_cache), "--trainer.max_steps", "2",
             "--trainer.logger", mine, "--default_loggers", "false", cwd=tmp_path)
    assert not (alone / "csv").exists() and not (alone / "tb").exists()
    assert len(list((tmp_path / "mine" / "stand_in_for_wandb").glob("version_*/metrics.csv"))) == 2


@pytest.mark.slow
def test_one_run_folder_holds_one_model(tmp_path, corpus_cache, flexmoba):
    """A second fresh fit into a folder with checkpoints, and a checkpoint of another shape, are
    one-line errors (exit 2) instead of a last-v1.ckpt or a size-mismatch traceback."""
    flexmoba("fit", *tiny_args("moba.yaml", tmp_path, corpus_cache), "--trainer.max_steps", "3", cwd=tmp_path)

    def refused(*args):
        proc = subprocess.run([sys.executable, "-m", "lit.cli.main", *args], cwd=tmp_path, capture_output=True,
                              text=True, timeout=300)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("flexmoba: error:")]
        assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr
        return errors[0]

    assert "already holds a run's checkpoints" in refused("fit", *tiny_args("full.yaml", tmp_path, corpus_cache))
    other_shape = refused("validate", "--config", str(CONFIGS / "moba.yaml"), "--trainer.default_root_dir",
                          str(tmp_path), "--data.cache_dir", str(corpus_cache), "--ckpt_path", "last")
    assert "holds another model" in other_shape and "d_model 32 != 128" in other_shape
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("*.ckpt")) == ["last.ckpt", "step000003.ckpt"]


@pytest.mark.parametrize("subcommand", ["fit", "validate"])
def test_help_shows_flexmoba_s_options_first_and_lightning_s_after_them(subcommand, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["flexmoba"])
    with pytest.raises(SystemExit):
        run_cli([subcommand, "--help"])
    page = capsys.readouterr().out
    lines = page.splitlines()
    assert lines[0].startswith("usage: flexmoba ") and lines[1] == "", lines[:3]  # one line, not one per option
    assert lines[0].endswith(f" {subcommand} [--config FILE] [--OPTION VALUE ...]"), lines[:3]
    first_lightning = page.index("Lightning's options from here on. The Trainer (--trainer.*):")
    # the architecture and the default data module's options are listed, not left to --model.config.help/--data.help
    own = ["--ckpt_path", "--model.lr", "--model.config.n_layers", "--model.config.moba.chunk_size",
           "--model.config.moba.top_k", "--data.root", "--data.seq_len", "--data.max_files",
           "--divergence_guard.check_every_n_steps", "--checkpoint.every_n_train_steps"]
    for option in own:
        assert -1 < page.find(f"  {option} ") < first_lightning, option
    assert page.index("  --trainer.max_steps ") > first_lightning
    assert "--model.config.moba.chunk_size CHUNK_SIZE\n" in page and "(type: int, default: 128)" in page
