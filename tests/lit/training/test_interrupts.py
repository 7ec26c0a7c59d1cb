"""Ctrl-C is remembered: raised at once, again at the next batch if something swallowed it, and held back
while a checkpoint is written (which then loads whole)."""

import os
import signal

import pytest
import torch

from lit.training.guards import InterruptAtBatchBoundaries, atomic_torch_save
from lit.training.interrupts import installed_requests, interrupt_requests, interrupts_deferred


def ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)  # delivered to this (the main) thread before kill returns to Python


def test_ctrl_c_raises_at_once_and_the_previous_handler_comes_back():
    previous = signal.getsignal(signal.SIGINT)
    with interrupt_requests() as requests:
        assert installed_requests() is requests
        with pytest.raises(KeyboardInterrupt):
            ctrl_c()
        assert requests.requested
    assert signal.getsignal(signal.SIGINT) is previous and installed_requests() is None


def test_a_swallowed_ctrl_c_stops_the_run_at_the_next_batch():
    boundary = InterruptAtBatchBoundaries()
    with interrupt_requests():
        boundary.on_train_batch_start(None, None, None, 0)  # nothing requested: goes on
        try:
            ctrl_c()
        except KeyboardInterrupt:
            pass  # as a __del__ running when the signal came would drop it
        for hook in (boundary.on_train_batch_start, boundary.on_train_batch_end, boundary.on_validation_batch_start):
            with pytest.raises(KeyboardInterrupt):
                hook(None, None, None, None, 0)


def test_ctrl_c_inside_a_deferred_block_raises_when_the_whole_block_has_run():
    ran = []
    with interrupt_requests(), pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            with interrupts_deferred():
                ctrl_c()
                ran.append("inner")
            ran.append("outer")  # still deferred: the outer block has not ended
        ran.append("after")
    assert ran == ["inner", "outer"]


class SendsCtrlC:
    """Pickled in the middle of a checkpoint: Ctrl-C arrives while torch.save writes."""

    def __reduce__(self):
        ctrl_c()
        return (list, ([1, 2, 3],))


def test_ctrl_c_while_a_checkpoint_is_written_waits_for_the_whole_file(tmp_path):
    path = tmp_path / "step.ckpt"
    checkpoint = {"before": torch.arange(10_000), "signal": SendsCtrlC(), "after": torch.ones(10_000)}
    with interrupt_requests(), pytest.raises(KeyboardInterrupt):
        atomic_torch_save(checkpoint, path)
    loaded = torch.load(path, weights_only=False)  # the test's own file: a list by reduce
    assert loaded["signal"] == [1, 2, 3] and torch.equal(loaded["after"], torch.ones(10_000))
    assert [p.name for p in tmp_path.iterdir()] == ["step.ckpt"]  # no temporary left


def test_outside_a_command_ctrl_c_is_python_s_own():
    assert installed_requests() is None
    with interrupts_deferred(), pytest.raises(KeyboardInterrupt):
        ctrl_c()
