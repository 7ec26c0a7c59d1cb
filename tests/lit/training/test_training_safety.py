"""Training that fails loudly and resumes exactly: divergence guard, checkpoint safety, CLI errors."""

import csv
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from conftest import flexmoba_command, read_metrics

from flexmoba import MobaSpec
from flexmoba.checkpoint import load_model, read_checkpoint
from flexmoba.model import ModelConfig
from lit.cli import lightning_cli
from lit.cli.errors import config_line, one_line_error
from lit.training.errors import ConfigError
from lit.training.guards import (
    DivergenceGuard,
    SafeModelCheckpoint,
    TrainingDiverged,
    atomic_torch_save,
    checkpoint_problem,
    newest_intact_checkpoint,
)
from lit.training.launch import run_cli
from lit.training.metrics import IGNORE_INDEX, WindowedLoss, position_windows
from lit.training.module import LitLM

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
ERROR_LINE = re.compile(r"^flexmoba: error: (.+)$")


def tiny_args(root, cache, *extra: str) -> list[str]:
    return ["--config", str(CONFIGS / "moba.yaml"), "--config", str(CONFIGS / "tiny.yaml"),
            "--trainer.default_root_dir", str(root), "--data.cache_dir", str(cache),
            "--trainer.enable_progress_bar", "false", *extra]


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The CLI in a subprocess, whatever its exit code."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([*flexmoba_command(), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ERROR_LINE.match(line)]


def global_step(path: Path) -> int:
    return int(read_checkpoint(path)["global_step"])


# -- CLI errors ---------------------------------------------------------------------------------

BAD_VALUES = [
    ("--model.config.moba.chunk_size", "0", "must be >= 1"),
    ("--model.config.moba.top_k", "0", "must be >= 1"),
    ("--model.config.moba.granularity", "5", "must divide chunk_size=32"),
    ("--data.seq_len", "0", "must be a positive int"),
    ("--data.seq_len", "abc", "must be int"),
    ("--model.config.attention", "local", "must be one of ('moba', 'full')"),
    ("--model.config.moba.backend", "triton", "must be one of"),
    ("--model.trailing_window", "500", "must be in [1, seq_len=128]"),
    ("--divergence_guard.check_every_n_steps", "0", "restriction v>0"),
]


@pytest.mark.parametrize(("option", "value", "rule"), BAD_VALUES, ids=[f"{o}={v}" for o, v, _ in BAD_VALUES])
def test_bad_value_is_one_line_naming_the_option_and_exit_2(option, value, rule, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["flexmoba"])
    root = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        lightning_cli.main(["fit", *tiny_args(root, tmp_path / "cache"), option, value])
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    assert stderr.count("\n") == 1, stderr
    assert stderr.startswith(f"flexmoba: error: {option}: ") and rule in stderr, stderr
    assert not root.exists()  # refused at parse time: no trainer, logger, data or model


TYPOS = [("--trainr.max_steps", "--trainer.max_steps"), ("--model.lrr", "--model.lr"),
         ("--model.config.moba.top", "--model.config.moba.top_k"), ("--data.seq_lenn", "--data.seq_len")]


@pytest.mark.parametrize(("typo", "meant"), TYPOS)
def test_a_mistyped_option_suggests_the_nearest_one(typo, meant, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["flexmoba"])
    with pytest.raises(SystemExit) as exit_info:
        lightning_cli.main(["fit", *tiny_args(tmp_path / "run", tmp_path / "cache"), typo, "3"])
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 2 and stderr.count("\n") == 1, stderr
    assert stderr.rstrip().endswith(f"did you mean {meant}?"), stderr


def test_the_launcher_raises_and_the_command_words_the_line(tmp_path, capsys, monkeypatch):
    """Training prints nothing and exits nothing: its parser raises ConfigError, which the command says."""
    monkeypatch.setattr(sys, "argv", ["flexmoba"])
    with pytest.raises(ConfigError) as error:
        run_cli(["fit", *tiny_args(tmp_path / "run", tmp_path / "cache"), "--model.config.moba.top_k", "0"])
    assert capsys.readouterr().err == ""
    assert error.value.message == "--model.config: MobaSpec.top_k must be >= 1, got 0"
    assert config_line(error.value) == "--model.config.moba.top_k: must be >= 1, got 0"


def test_bad_value_from_the_real_command_is_its_only_stderr_line(tmp_path):
    proc = run("fit", *tiny_args(tmp_path / "run", tmp_path / "cache"), "--model.config.moba.top_k", "0",
               cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr == "flexmoba: error: --model.config.moba.top_k: must be >= 1, got 0\n"


def test_nested_union_message_becomes_one_line():
    message = ('Parser key "data":\n  Does not validate against any of the Union subtypes\n  Errors:\n'
               "    - Problem with given class_path 'lit.training.data.ByteFilesData':\n"
               '        Parser key "seq_len":\n          Expected a <class \'int\'>. Got value: abc\n'
               "    - Expected a <class 'NoneType'>\n  Given value type: <class 'NestedArg'>")
    assert one_line_error(message) == "--data.seq_len: must be int, got 'abc'"


# -- divergence guard, in process -----------------------------------------------------------------

class BreaksAtStep(L.LightningModule):
    """A linear model whose loss (``what="loss"``) or only its gradient (``"grad"``) turns NaN at ``step``."""

    def __init__(self, step: int, what: str):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.break_step, self.what = step, what

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).pow(2).mean()
        if self.global_step >= self.break_step:
            if self.what == "loss":
                return loss * float("nan")
            weight = self.layer.weight
            return loss + (weight - weight).abs().sqrt().sum()  # value 0, gradient 0 * inf = NaN
        return loss

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 4)), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit_until_broken(tmp_path, step: int, what: str, every_n_steps: int | None = None,
                     checkpoint_every: int = 3) -> tuple[TrainingDiverged, L.Trainer, BreaksAtStep]:
    checkpoint = SafeModelCheckpoint(dirpath=tmp_path, every_n_train_steps=checkpoint_every, save_top_k=-1,
                                     save_last=True, save_on_exception=True, filename="{step}")
    guard = DivergenceGuard(check_every_n_steps=every_n_steps)
    trainer = L.Trainer(max_steps=16, callbacks=[guard, checkpoint], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    model = BreaksAtStep(step, what)
    with pytest.raises(TrainingDiverged) as diverged:
        trainer.fit(model)
    return diverged.value, trainer, model


def saved_steps(folder: Path) -> list[int]:
    return sorted(global_step(path) for path in folder.glob("*.ckpt"))


@pytest.mark.parametrize(("what", "name"), [("loss", "train/loss"), ("grad", "grad norm")])
def test_guard_on_cpu_stops_at_the_bad_step_and_saves_nothing_from_it(what, name, tmp_path):
    """On CPU the guard checks every step: it stops at the bad step, before its optimizer step."""
    diverged, trainer, model = fit_until_broken(tmp_path, step=4, what=what)
    assert str(diverged) == f"training diverged at step 4: {name} = nan"
    assert trainer.global_step == 4
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == ["last.ckpt", "step=3.ckpt"]
    assert global_step(tmp_path / "last.ckpt") == 3


@pytest.mark.parametrize(("what", "name"), [("loss", "train/loss"), ("grad", "grad norm")])
def test_guard_checking_every_n_steps_stops_within_n_steps_naming_the_first_bad_one(what, name, tmp_path):
    """Checked at steps 3, 7, 11, ...: a NaN at step 5 stops the run at step 7, named step 5."""
    diverged, trainer, _ = fit_until_broken(tmp_path, step=5, what=what, every_n_steps=4, checkpoint_every=100)
    assert str(diverged) == f"training diverged at step 5: {name} = nan"
    assert diverged.step == 5 and trainer.global_step == 7
    assert list(tmp_path.glob("*.ckpt")) == []  # no checkpoint was due; none written on the exception either


def test_a_checkpoint_due_after_a_bad_step_is_refused(tmp_path):
    """Checked every 10 steps, a checkpoint every step: the one after bad step 4 (global step 5,
    holding its update) is never written; the last one holds the weights before step 4."""
    diverged, trainer, _ = fit_until_broken(tmp_path, step=4, what="loss", every_n_steps=10, checkpoint_every=1)
    assert diverged.step == 4 and trainer.global_step == 5
    assert saved_steps(tmp_path) == [1, 2, 3, 4, 4]  # step=1..4.ckpt and last.ckpt
    weights = read_checkpoint(tmp_path / "last.ckpt")["state_dict"]
    assert all(torch.isfinite(w).all() for w in weights.values())


@pytest.mark.parametrize("every", [0, -1, 2.5, True])
def test_bad_check_interval_names_the_parameter(every):
    with pytest.raises(ValueError, match="check_every_n_steps must be a positive int"):
        DivergenceGuard(check_every_n_steps=every)


class NoHostReads:
    """Every way of reading a tensor on the host raises inside this block."""

    METHODS = ("__bool__", "__int__", "__float__", "__index__", "item", "tolist", "numpy")

    def __init__(self, monkeypatch, device: torch.device):
        self.monkeypatch, self.device = monkeypatch, device

    def __enter__(self):
        def refuse(*args, **kwargs):
            raise AssertionError("host read")
        for method in self.METHODS:
            self.monkeypatch.setattr(torch.Tensor, method, refuse)
        if self.device.type == "cuda":  # and no implicit synchronisation either
            torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
        self.monkeypatch.undo()


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.mark.parametrize("device", DEVICES)
def test_guard_records_each_step_without_reading_the_host(device, monkeypatch):
    device = torch.device(device)
    model = BreaksAtStep(step=1, what="loss").to(device)
    trainer = SimpleNamespace(global_step=0, precision_plugin=None,
                              strategy=SimpleNamespace(root_device=device, reduce=lambda t, **_: t))
    model._trainer = trainer
    guard = DivergenceGuard(check_every_n_steps=3)
    guard.on_train_start(trainer, model)
    for step in range(3):
        trainer.global_step = step
        loss = model.training_step((torch.randn(4, 4, device=device),), step)
        loss.backward()
        with NoHostReads(monkeypatch, device):
            guard.on_before_backward(trainer, model, loss)
            if step < 2:
                guard.on_before_optimizer_step(trainer, model, None)
    with pytest.raises(TrainingDiverged, match="at step 1: train/loss = nan"):
        guard.on_before_optimizer_step(trainer, model, None)  # step 2: the check


def test_validation_reports_nan_instead_of_dropping_it():
    """A NaN in one of two validation batches: every metric is NaN (torchmetrics' default would drop it)."""
    model = LitLM(ModelConfig(n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, moba=MobaSpec(16, 2,
                  backend="sdpa"), tie_embeddings=False), seq_len=64, position_window=32,
                  trailing_window=32)
    with torch.no_grad():
        model.model.tok_emb.weight[7] = float("nan")
    tokens = torch.randint(8, 256, (2, 65))
    tokens[1, 0] = 7  # the second sequence's losses are all NaN, the first's all finite
    batches = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=1)
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    trainer.validate(model, dataloaders=batches, verbose=False)
    logged = trainer.callback_metrics
    for name in ("val/loss", "val/ppl", "val/loss_pos_000000_000032", "val/loss_pos_000032_000064",
                 "val/loss_trailing"):
        assert name in logged and torch.isnan(logged[name]), name


def test_windowed_loss_tells_an_unreached_window_from_a_nan_one():
    metric = WindowedLoss(position_windows(6, 2))
    targets = torch.tensor([[1, 1, 1, 1, IGNORE_INDEX, IGNORE_INDEX]])  # reaches windows [0, 2) and [2, 4) only
    metric.update(torch.tensor([[1.0, 1.0, float("nan"), 1.0, 1.0, 1.0]]), targets)
    losses = metric.compute()
    assert metric.reached().tolist() == [True, True, False]
    assert losses[0] == 1.0 and losses[1:].isnan().all()


# -- divergence guard, through the CLI ----------------------------------------------------------

def test_huge_learning_rate_stops_with_one_line_and_keeps_the_last_good_checkpoint(tmp_path, corpus_cache):
    proc = run("fit", *tiny_args(tmp_path, corpus_cache), "--model.lr", "1e6", "--checkpoint.every_n_train_steps",
               "1", "--checkpoint.save_on_exception", "true", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    [line] = error_lines(proc.stderr)
    match = re.fullmatch(r"flexmoba: error: training diverged at step (\d+): (train/loss|grad norm) = (nan|inf|-inf)",
                         line)
    assert match, line
    bad_step = int(match[1])
    checkpoints = sorted((tmp_path / "checkpoints").glob("*.ckpt"))
    assert checkpoints and all(global_step(p) <= bad_step for p in checkpoints)
    model = load_model(tmp_path / "checkpoints" / "last.ckpt")
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert torch.isfinite(model(torch.zeros(1, 8, dtype=torch.long))).all()


# -- checkpoints ----------------------------------------------------------------------------------

def test_atomic_save_leaves_the_old_file_when_the_write_fails(tmp_path):
    path = tmp_path / "last.ckpt"
    atomic_torch_save({"step": 1}, path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_torch_save({"step": 2, "bad": Unpicklable()}, path)
    assert torch.load(path) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temporary file left behind


def test_newest_intact_checkpoint_skips_truncated_files(tmp_path):
    for step in (2, 4):
        atomic_torch_save({"step": step}, tmp_path / f"step{step}.ckpt")
        time.sleep(0.01)
    atomic_torch_save({"step": 4}, tmp_path / "last.ckpt")
    truncate(tmp_path / "last.ckpt")
    (tmp_path / "gone.ckpt").symlink_to(tmp_path / "removed.ckpt")  # save_last="link" to a removed file
    chosen, skipped = newest_intact_checkpoint(tmp_path)
    assert chosen == tmp_path / "step4.ckpt" and list(skipped) == [tmp_path / "last.ckpt"]


def test_a_sharded_checkpoint_folder_is_intact_once_its_metadata_is_written(tmp_path):
    folder = tmp_path / "step6.ckpt"
    folder.mkdir()
    (folder / "__0_0.distcp").write_bytes(b"shard")
    assert checkpoint_problem(folder) == "sharded checkpoint without .metadata, meta.pt"
    (folder / ".metadata").write_bytes(b"index")
    torch.save({"global_step": 6}, folder / "meta.pt")
    assert checkpoint_problem(folder) is None


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.slow
def test_truncated_last_checkpoint_falls_back_and_finishes(tmp_path, corpus_cache, flexmoba):
    common = ["--checkpoint.every_n_train_steps", "2", "--checkpoint.save_top_k", "-1"]
    flexmoba("fit", *tiny_args(tmp_path, corpus_cache), *common, "--trainer.max_steps", "4", cwd=tmp_path)
    truncate(tmp_path / "checkpoints" / "last.ckpt")
    proc = flexmoba("fit", *tiny_args(tmp_path, corpus_cache), *common, "--trainer.max_steps", "6",
                    "--ckpt_path", "last", cwd=tmp_path)
    assert ("flexmoba: warning: --ckpt_path last: skipped unreadable last.ckpt (moved to last.ckpt.unreadable); "
            "using step000004.ckpt") in proc.stderr
    assert global_step(tmp_path / "checkpoints" / "last.ckpt") == 6
    assert global_step(tmp_path / "checkpoints" / "step000004.ckpt") == 4  # resumed from it, not from scratch
    for path in (tmp_path / "checkpoints").glob("*.ckpt"):
        truncate(path)
    proc = run("fit", *tiny_args(tmp_path, corpus_cache), "--trainer.max_steps", "8", "--ckpt_path", "last",
               cwd=tmp_path)
    assert proc.returncode == 2
    [line] = error_lines(proc.stderr)
    assert line.startswith("flexmoba: error: --ckpt_path: last: no usable checkpoint in ")


# -- exact resume after SIGKILL -------------------------------------------------------------------

def final_values(rows: list[dict[str, str]]) -> dict[str, float]:
    """The last logged value of every loss, learning rate and validation metric, with the step it was logged at."""
    values = {}
    for row in rows:
        for key, value in row.items():
            if value and key.startswith(("train/loss", "train/lr", "train/moba_layers", "val/")):
                values[key] = (int(row["step"]), float(value))
    return values


# 3 batches an epoch: resumed runs cross epochs and reshuffle; every checkpoint kept, so the one
# the kill waits for cannot be rotated away before the poll sees it
KILL_RUN = ["--trainer.max_steps", "12", "--checkpoint.every_n_train_steps", "2", "--trainer.val_check_interval", "4",
            "--trainer.limit_train_batches", "3", "--checkpoint.save_top_k", "-1"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, corpus_cache) -> dict[str, tuple[int, float]]:
    root = tmp_path_factory.mktemp("uninterrupted")
    proc = run("fit", *tiny_args(root, corpus_cache), *KILL_RUN, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return final_values(read_metrics(root))


@pytest.mark.slow
@pytest.mark.parametrize("kill_after", ["step000002.ckpt", "step000006.ckpt"], ids=["mid-epoch", "epoch-end"])
def test_run_killed_after_a_checkpoint_resumes_to_the_same_metrics(kill_after, uninterrupted, tmp_path,
                                                                   corpus_cache):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([*flexmoba_command(), "fit", *tiny_args(tmp_path, corpus_cache), *KILL_RUN], cwd=tmp_path,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while not (tmp_path / "checkpoints" / kill_after).exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL  # killed mid-run, not finished
    newest, _ = newest_intact_checkpoint(tmp_path / "checkpoints")
    killed_at = global_step(newest)  # read now: resuming rewrites last.ckpt
    assert killed_at < 12
    resumed_run = run("fit", *tiny_args(tmp_path, corpus_cache), *KILL_RUN, "--ckpt_path", "last", cwd=tmp_path)
    assert resumed_run.returncode == 0, resumed_run.stderr[-3000:]
    resumed_rows = csv_rows(tmp_path)
    assert min(int(r["step"]) for r in resumed_rows if r.get("train/loss")) == killed_at  # not from scratch
    resumed = final_values(resumed_rows)
    assert set(resumed) == set(uninterrupted) and uninterrupted["train/loss"][0] == 11
    for key, (step, value) in uninterrupted.items():
        assert resumed[key][0] == step and resumed[key][1] == pytest.approx(value, rel=1e-6, abs=1e-7), key


def csv_rows(root: Path) -> list[dict[str, str]]:
    """Rows of the newest CSVLogger version (the resumed run's own metrics.csv)."""
    newest = max((root / "csv").glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    with open(newest / "metrics.csv") as f:
        return list(csv.DictReader(f))
