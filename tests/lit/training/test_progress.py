"""What a run says besides its metrics: progress lines when stdout is not a terminal, and a MoBA that cannot be
sparse. (The lines of real runs are checked in tests/lit/cli/test_console.py and tests/lit/experiments.)"""

import time
from types import SimpleNamespace

import pytest
import torch

from flexmoba import MobaSpec
from flexmoba.model import ModelConfig
from lit.training import progress
from lit.training.errors import UsageError
from lit.training.ticker import Ticker


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def fake_trainer(step: int = 0) -> SimpleNamespace:
    return SimpleNamespace(global_step=step, max_steps=100, estimated_stepping_batches=100, world_size=2,
                           callback_metrics={}, num_val_batches=[32], sanity_checking=False,
                           state=SimpleNamespace(fn="fit"))


def test_a_progress_line_comes_at_least_every_interval_and_no_sooner(capsys):
    clock = Clock()
    lines = progress.ProgressLines(60, clock, ticking=False)
    trainer, module = fake_trainer(), SimpleNamespace()
    batch = (torch.zeros(4, 128, dtype=torch.long), torch.zeros(4, 128, dtype=torch.long))
    lines.on_train_start(trainer, module)
    for step in range(1, 11):  # a step every 10 s: a line at 60 s, none before
        clock.now += 10
        trainer.global_step = step
        lines.on_train_batch_end(trainer, module, {"loss": torch.tensor(2.5)}, batch, step - 1)
    assert capsys.readouterr().err.splitlines() == [
        "flexmoba: step 6/100: loss 2.5000, 102 tokens/s, 15m 40s left"]  # 6 x 512 x 2 processes / 60 s
    lines.on_validation_start(trainer, module)
    for _ in range(3):  # a slow validation is not mute either: 50 s a batch
        clock.now += 50
        lines.on_validation_batch_end(trainer, module, None, batch, 0)
    assert capsys.readouterr().err.splitlines() == [
        "flexmoba: validation batch 1/32: 20 tokens/s, 25m 50s left",  # 90 s after the last line
        "flexmoba: validation batch 3/32: 20 tokens/s, 24m 10s left"]
    lines.on_validation_end(trainer, module)
    clock.now += 60
    trainer.global_step = 11
    lines.on_train_batch_end(trainer, module, {"loss": torch.tensor(2.0)}, batch, 10)
    # the 150 s of validation are not training time: 11 steps in 160 s
    assert capsys.readouterr().err.splitlines() == ["flexmoba: step 11/100: loss 2.0000, 70 tokens/s, 21m 35s left"]


def test_a_step_longer_than_the_interval_is_not_silent(capsys):
    clock = Clock()
    lines = progress.ProgressLines(60, clock, ticking=False)
    trainer, module = fake_trainer(), SimpleNamespace()
    batch = (torch.zeros(4, 128, dtype=torch.long), torch.zeros(4, 128, dtype=torch.long))
    assert lines.running_line() is None  # nothing started: nothing to say
    lines.on_train_start(trainer, module)
    clock.now += 30
    trainer.global_step = 1
    lines.on_train_batch_end(trainer, module, {"loss": torch.tensor(2.5)}, batch, 0)
    assert lines.running_line() == "step 1/100: 34 tokens/s, 49m 30s left"  # the step just ended
    clock.now += 75  # the second step runs on
    assert lines.running_line() == "step 1/100 (step 2 running for 1m 15s): 10 tokens/s, 2h 53m left"
    lines.on_validation_start(trainer, module)
    clock.now += 61
    assert lines.running_line() == "validation: batch 1 running for 1m 01s"
    lines.on_validation_batch_end(trainer, module, None, batch, 0)
    clock.now += 70
    assert lines.running_line() == "validation batch 1/32 (batch 2 running for 1m 10s): 8 tokens/s, 1h 07m left"
    # at the batch's end, its own line (the timer's thread, off here, says the running ones)
    assert capsys.readouterr().err.splitlines() == ["flexmoba: validation batch 1/32: 17 tokens/s, 31m 31s left"]


def test_the_timer_says_a_line_each_interval_without_one():
    said = []
    with Ticker(0.1, lambda: "alive", said.append):
        time.sleep(0.55)
    assert 3 <= len(said) <= 6 and set(said) == {"alive"}
    said.clear()
    ticker = Ticker(0.1, lambda: "alive", said.append).start()
    for _ in range(20):  # lines said elsewhere every 0.03 s: the timer has nothing to add
        ticker.said()
        time.sleep(0.03)
    ticker.stop()
    assert said == []
    with Ticker(0.05, lambda: None, said.append):  # a None line: nothing said
        time.sleep(0.2)
    assert said == []


@pytest.mark.parametrize("given, seconds", [(None, 60.0), ("", 60.0), ("0", 0.0), ("2.5", 2.5)])
def test_the_interval_comes_from_the_environment(given, seconds, monkeypatch):
    if given is None:
        monkeypatch.delenv(progress.PROGRESS_SECONDS, raising=False)
    else:
        monkeypatch.setenv(progress.PROGRESS_SECONDS, given)
    assert progress.progress_seconds() == seconds


@pytest.mark.parametrize("given", ["soon", "-1", "nan"])
def test_an_interval_that_is_not_seconds_names_the_variable(given, monkeypatch):
    monkeypatch.setenv(progress.PROGRESS_SECONDS, given)
    with pytest.raises(UsageError, match=f"FLEXMOBA_PROGRESS_SECONDS: must be a number of seconds >= 0, got '{given}'"):
        progress.progress_seconds()


def test_progress_lines_are_added_when_stdout_is_not_a_terminal(monkeypatch):
    monkeypatch.delenv(progress.PROGRESS_SECONDS, raising=False)
    for interactive, added in [(True, 0), (False, 1)]:
        trainer = SimpleNamespace(callbacks=[])
        progress.with_own_display(trainer, interactive=interactive)
        assert sum(isinstance(c, progress.ProgressLines) for c in trainer.callbacks) == added


@pytest.mark.parametrize("seq_len, chunk_size, top_k, attention, says", [
    (128, 64, 2, "moba", True),   # 64 x 2 = 128: every earlier key is in a selected chunk
    (128, 256, 3, "moba", True),
    (129, 64, 2, "moba", False),  # the last query skips a chunk
    (128, 64, 2, "full", False),
])
def test_moba_that_cannot_be_sparse_is_named(seq_len, chunk_size, top_k, attention, says):
    config = ModelConfig(n_layers=2, d_model=32, n_heads=2, attention=attention, moba=MobaSpec(chunk_size, top_k))
    note = progress.moba_note(config, seq_len)
    if not says:
        assert note is None
        return
    assert note == (f"note: MoBA at seq_len {seq_len} with chunk_size {chunk_size} × top_k {top_k} attends every "
                    "earlier key (equals full attention); lower chunk_size or top_k to make it sparse")
    assert config.attention_sparsity(seq_len) == 0.0  # what the note says, by the model's own count
