"""Training that fails loudly and keeps its checkpoints trustworthy.

- :class:`DivergenceGuard` stops a run within ``check_every_n_steps`` steps of the first non-finite
  loss or gradient norm, naming that step, by raising :class:`TrainingDiverged`; it refuses every
  checkpoint written after it, so none holds weights from a bad step.
- :class:`SafeModelCheckpoint` never saves on a divergence, even with ``save_on_exception``.
- :class:`AtomicCheckpointIO` writes each checkpoint to a temporary name in the same folder,
  fsyncs it and renames it over the old one, so a kill or a full disk never leaves half a file; a Ctrl-C
  while it writes waits for the whole file.
- :class:`InterruptAtBatchBoundaries` stops the run at the next batch once Ctrl-C was pressed, even when
  the first KeyboardInterrupt was swallowed.
- :func:`newest_intact_checkpoint` picks the checkpoint ``--ckpt_path last`` can resume from.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import lightning as L
import torch
from jsonargparse.typing import PositiveInt
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lit.training import metric_names
from lit.training.errors import TrainingDiverged
from lit.training.grad_norm import step_grad_norm
from lit.training.interrupts import installed_requests, interrupts_deferred


def gradients_are_loss_scaled(trainer: L.Trainer) -> bool:
    """fp16 loss scaling makes inf gradients routine: the scaler skips those steps itself."""
    return getattr(trainer.precision_plugin, "scaler", None) is not None


NO_BAD_STEP = torch.iinfo(torch.int64).max
WATCHED = (metric_names.loss("train"), "grad norm")  # what the first bad value was, by index
CPU_CHECK_EVERY_N_STEPS = 1  # reading a CPU tensor waits for nothing
DEVICE_CHECK_EVERY_N_STEPS = 10


class FirstNonFinite:
    """The first step whose watched value was not finite, its index in :data:`WATCHED` and the
    value, all kept on one device and updated there: recording never reads a value on the host."""

    def __init__(self, device: torch.device):
        self.step = torch.full((), NO_BAD_STEP, dtype=torch.int64, device=device)
        self.what = torch.zeros((), dtype=torch.int64, device=device)
        self.value = torch.zeros((), dtype=torch.float32, device=device)

    def record(self, step: int, what: int, value: torch.Tensor) -> None:
        first = ~torch.isfinite(value).all() & (self.step == NO_BAD_STEP)
        self.step = torch.where(first, step, self.step)
        self.what = torch.where(first, what, self.what)
        self.value = torch.where(first, value.detach().float().sum(), self.value)


class DivergenceGuard(L.Callback):
    """Stop training soon after the first non-finite training loss or gradient norm, naming that step.

    Each step's loss (before its backward) and gradient norm (before its optimizer step) are
    folded into :class:`FirstNonFinite` on the device, without a host read. The host reads the
    first bad step only every ``check_every_n_steps`` steps (before that step's optimizer step),
    at the end of training, and before any checkpoint is written. So a run stops at most
    ``check_every_n_steps - 1`` steps after its first bad step, and no checkpoint from a bad
    step is ever written: the one about to be is refused. Under DDP every process stops when
    any one saw a non-finite value.

    Args:
        check_grad_norm: also check the total gradient norm (skipped under fp16 loss scaling).
        check_every_n_steps: steps between host reads; default 1 when training on CPU (a read
            costs nothing there, and the run stops at the bad step itself, before its optimizer
            step, so even the weights in memory never take it) and 10 on accelerators (the
            weights in memory may take up to 9 bad steps; they are never saved).
    """

    def __init__(self, check_grad_norm: bool = True, check_every_n_steps: PositiveInt | None = None):
        if check_every_n_steps is not None and (
                isinstance(check_every_n_steps, bool) or not isinstance(check_every_n_steps, int)
                or check_every_n_steps < 1):
            raise ValueError(f"check_every_n_steps must be a positive int or None, got {check_every_n_steps!r}")
        self.check_grad_norm = check_grad_norm
        self.check_every_n_steps = check_every_n_steps
        self.first: FirstNonFinite | None = None
        self.every_n_steps = check_every_n_steps or DEVICE_CHECK_EVERY_N_STEPS

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        device = trainer.strategy.root_device
        self.first = FirstNonFinite(device)
        default = CPU_CHECK_EVERY_N_STEPS if device.type == "cpu" else DEVICE_CHECK_EVERY_N_STEPS
        self.every_n_steps = self.check_every_n_steps or default

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        self.first.record(trainer.global_step, 0, loss)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        if self.check_grad_norm and not gradients_are_loss_scaled(trainer):
            norm = step_grad_norm(pl_module)
            if norm is not None:
                self.first.record(trainer.global_step, 1, norm)
        if (trainer.global_step + 1) % self.every_n_steps == 0:
            self.stop_if_diverged(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.stop_if_diverged(trainer)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self.stop_if_diverged(trainer)

    def stop_if_diverged(self, trainer: L.Trainer) -> None:
        """Raise :class:`TrainingDiverged` if any process recorded a non-finite value (one host read)."""
        if self.first is None:  # not trained yet
            return
        step = int(trainer.strategy.reduce(self.first.step.clone(), reduce_op="min"))
        if step == NO_BAD_STEP:
            return
        if int(self.first.step) != step:
            raise TrainingDiverged(step, f"{metric_names.loss('train')} or grad norm", None)
        raise TrainingDiverged(step, WATCHED[int(self.first.what)], float(self.first.value))


class InterruptAtBatchBoundaries(L.Callback):
    """A Ctrl-C whose KeyboardInterrupt something swallowed (a ``__del__`` running when it came) stops the run
    at the next batch boundary (:mod:`lit.training.interrupts`)."""

    @staticmethod
    def check() -> None:
        requests = installed_requests()
        if requests is not None:
            requests.raise_if_requested()

    def on_train_batch_start(self, *_, **__) -> None:
        self.check()

    def on_train_batch_end(self, *_, **__) -> None:
        self.check()

    def on_validation_batch_start(self, *_, **__) -> None:
        self.check()

    def on_test_batch_start(self, *_, **__) -> None:
        self.check()

    def on_predict_batch_start(self, *_, **__) -> None:
        self.check()


class SafeModelCheckpoint(ModelCheckpoint):
    """ModelCheckpoint that saves nothing when training diverged (the weights may be broken)."""

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, TrainingDiverged):
            super().on_exception(trainer, pl_module, exception)


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_torch_save(obj, path: str | os.PathLike) -> None:
    """``torch.save`` to ``path`` through a temporary file in its folder: fsync, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with interrupts_deferred():  # Ctrl-C waits for the file in its place
        try:
            with open(tmp, "wb") as f:
                torch.save(obj, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Checkpoints on local disk are written atomically; remote URLs keep Lightning's writer."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if storage_options is not None or "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        atomic_torch_save(checkpoint, path)


# Lightning's ModelParallel/FSDP strategies write torch.distributed.checkpoint's ".metadata", then "meta.pt".
SHARDED_CHECKPOINT_METADATA = (".metadata", "meta.pt")


def checkpoint_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a complete checkpoint (every zip member of a file read back; a sharded
    checkpoint folder's two metadata files, written last), or None.
    """
    if os.path.isdir(path):
        missing = [name for name in SHARDED_CHECKPOINT_METADATA if not os.path.isfile(os.path.join(path, name))]
        return f"sharded checkpoint without {', '.join(missing)}" if missing else None
    try:
        with zipfile.ZipFile(path) as archive:
            bad_member = archive.testzip()
    except (OSError, zipfile.BadZipFile, EOFError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return None if bad_member is None else f"corrupt member {bad_member}"


def newest_intact_checkpoint(folder: str | os.PathLike) -> tuple[Path | None, dict[Path, str]]:
    """The newest complete ``*.ckpt`` in ``folder`` (``last.ckpt`` first among equally new
    ones), and the problem of each newer one that was skipped.
    """
    files = [p for p in Path(folder).glob("*.ckpt") if p.exists()]  # not a dangling last.ckpt link
    files.sort(key=lambda p: (p.stat().st_mtime, p.name == "last.ckpt"), reverse=True)
    skipped = {}
    for path in files:
        problem = checkpoint_problem(path)
        if problem is None:
            return path, skipped
        skipped[path] = problem
    return None, skipped
