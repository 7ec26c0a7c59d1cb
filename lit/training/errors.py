"""Errors of a training run (importable without Lightning)."""

from __future__ import annotations

import math


class TrainingDiverged(RuntimeError):
    """A training loss or gradient norm became NaN or infinite."""

    def __init__(self, step: int, name: str, value: float):
        self.step, self.name, self.value = step, name, value
        shown = value if not math.isfinite(value) else f"{value} here, non-finite on another process"
        super().__init__(f"training diverged at step {step}: {name} = {shown}")
