"""Training callbacks."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.utilities import rank_zero_info


class AttentionPhaseSwitch(L.Callback):
    """Train with the configured (MoBA) attention, then switch every layer to full attention.

    The paper's training-phase hybrid: MoBA for the first ``switch_to_full_at`` fraction of
    the optimizer steps (0.9 in the paper), full attention for the rest. The switch is a
    function of the global step, so resuming from a checkpoint lands in the right phase.

    Args:
        switch_to_full_at: fraction of ``trainer.estimated_stepping_batches`` after which
            all layers attend fully; in ``[0, 1]``.
    """

    def __init__(self, switch_to_full_at: float = 0.9):
        if not 0.0 <= switch_to_full_at <= 1.0:
            raise ValueError(f"switch_to_full_at must be in [0, 1], got {switch_to_full_at!r}")
        self.switch_to_full_at = switch_to_full_at

    def switch_step(self, trainer: L.Trainer) -> int:
        return int(self.switch_to_full_at * trainer.estimated_stepping_batches)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx) -> None:
        model = pl_module.model
        if trainer.global_step >= self.switch_step(trainer) and model.attention_override != "full":
            model.set_attention_override("full")
            rank_zero_info(f"[AttentionPhaseSwitch] step {trainer.global_step}: all layers now use full attention")
