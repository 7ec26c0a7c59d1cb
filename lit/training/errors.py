"""Errors of a training run (importable without Lightning)."""

from __future__ import annotations


class TrainingDiverged(RuntimeError):
    """A training loss or gradient norm became NaN or infinite at ``step`` (the first such step).

    ``value`` is None on a process that saw only finite values (another one did not).
    """

    def __init__(self, step: int, name: str, value: float | None):
        self.step, self.name, self.value = step, name, value
        shown = f"{name} = {value}" if value is not None else "non-finite on another process"
        super().__init__(f"training diverged at step {step}: {shown}")
