"""Training that fails loudly and keeps its checkpoints trustworthy.

- :class:`DivergenceGuard` stops a run at the first non-finite loss or gradient norm, before
  the bad step reaches the weights, by raising :class:`TrainingDiverged`.
- :class:`SafeModelCheckpoint` never saves on a divergence, even with ``save_on_exception``.
- :class:`AtomicCheckpointIO` writes each checkpoint to a temporary name in the same folder,
  fsyncs it and renames it over the old one, so a kill or a full disk never leaves half a file.
- :func:`newest_intact_checkpoint` picks the checkpoint ``--ckpt_path last`` can resume from.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lit.training import metric_names
from lit.training.errors import TrainingDiverged


def gradients_are_loss_scaled(trainer: L.Trainer) -> bool:
    """fp16 loss scaling makes inf gradients routine: the scaler skips those steps itself."""
    return getattr(trainer.precision_plugin, "scaler", None) is not None


class DivergenceGuard(L.Callback):
    """Stop training at the first non-finite training loss or gradient norm.

    The loss is checked before its backward and the gradient norm before the optimizer step,
    so the weights never take the bad step and no checkpoint is written from it. Under DDP
    every process stops when any one sees a non-finite value.

    Args:
        check_grad_norm: also check the total gradient norm (skipped under fp16 loss scaling).
    """

    def __init__(self, check_grad_norm: bool = True):
        self.check_grad_norm = check_grad_norm

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        self._stop_if_non_finite(trainer, metric_names.loss("train"), loss.detach())

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        if not self.check_grad_norm or gradients_are_loss_scaled(trainer):
            return
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        if grads:
            self._stop_if_non_finite(trainer, "grad norm", torch.nn.utils.get_total_norm(grads))

    @staticmethod
    def _stop_if_non_finite(trainer: L.Trainer, name: str, value: torch.Tensor) -> None:
        non_finite = not bool(torch.isfinite(value).all())
        if trainer.strategy.reduce_boolean_decision(non_finite, all=False):
            raise TrainingDiverged(trainer.global_step, name, float(value))


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
