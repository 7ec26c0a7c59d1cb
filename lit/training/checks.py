"""Checks a job runs on what it is given before doing any work: checkpoints to read, folders to
write, devices to run on. Each raises :class:`lit.training.errors.UsageError` naming the option.

The one rule for outputs: nothing a subcommand wrote before is replaced unless ``--overwrite true`` says so.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

from lit.training.errors import UsageError


def checkpoint_file(option: str, path: str | Path) -> dict:
    """The flexmoba checkpoint at ``path``, read (tensors mapped, not loaded)."""
    from flexmoba.checkpoint import checkpoint_config, read_checkpoint

    path = Path(path)
    if not path.exists():
        raise UsageError(option, f"{path} does not exist", "give the path of a checkpoint, e.g. "
                         "<run>/checkpoints/last.ckpt")
    if path.is_dir():
        raise UsageError(option, f"{path} is a folder", "give a checkpoint file in it, e.g. "
                         f"{path / 'checkpoints' / 'last.ckpt'}")
    if not zipfile.is_zipfile(path):
        raise UsageError(option, f"{path} is not a checkpoint (not a file torch.save wrote; truncated?)",
                         "give a .ckpt file that flexmoba fit or compare wrote")
    try:
        checkpoint = read_checkpoint(path)
        checkpoint_config(checkpoint)
    except (ValueError, RuntimeError, TypeError) as error:
        raise UsageError(option, f"{path} is not a flexmoba checkpoint ({error})",
                         "give a .ckpt file that flexmoba fit or compare wrote") from None
    return checkpoint


def output_folder(option: str, path: str | Path, overwrite: bool) -> Path:
    """``path`` as a folder to write into: refused if it is a file, or holds files and ``overwrite`` is off."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UsageError(option, f"{path} is a file, not a folder", "give a folder to write into")
    held = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    if held and not overwrite:
        shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise UsageError(option, f"{path} already holds output ({shown})",
                         "pass --overwrite true to replace it, or give another folder")
    return path


ACCELERATORS = {"gpu": ("cuda", "mps"), "cuda": ("cuda",), "mps": ("mps",)}


def available(kind: str) -> bool:
    import torch

    if kind == "cuda":
        return torch.cuda.is_available()
    return kind == "mps" and torch.backends.mps.is_available()


def accelerator(option: str, name: str | None) -> None:
    """``--trainer.accelerator gpu`` (or cuda, mps) on a machine without one is refused."""
    kinds = ACCELERATORS.get(str(name).lower())
    if kinds and not any(available(kind) for kind in kinds):
        raise UsageError(option, f"{name}: this machine has no {' or '.join(k.upper() for k in kinds)} device",
                         f"pass {option} cpu, or auto (a GPU when there is one)")


def device(option: str, name: str) -> str:
    """``--device``: ``auto`` resolved (CUDA when there is a GPU, else CPU); a device this machine lacks refused."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind = name.split(":")[0]
    if kind in ("cuda", "mps") and not available(kind):
        raise UsageError(option, f"{name}: this machine has no {kind.upper()} device",
                         f"pass {option} cpu, or auto (a GPU when there is one)")
    try:
        torch.device(name)
    except RuntimeError as error:
        raise UsageError(option, f"{name!r} is not a device ({error})", "pass cpu, cuda, cuda:1, mps or auto") from None
    return name
