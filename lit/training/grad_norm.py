"""The total gradient norm of an optimizer step, computed once however many ask for it.

The module logs it (``train/grad_norm``) and the divergence guard checks it, both before the
optimizer step; Lightning calls the guard's hook first, so whichever asks first computes it
and the other reuses that tensor. It stays on the device: nothing here reads it on the host.
"""

from __future__ import annotations

import lightning as L
import torch

_CACHE_ATTR = "_step_grad_norm"


def total_grad_norm(module: torch.nn.Module) -> torch.Tensor | None:
    """Total 2-norm ``[]`` of every gradient of ``module`` (a plain tensor also under FSDP2), or None."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads:
        return None
    norm = torch.nn.utils.get_total_norm(grads)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # a DTensor from sharded gradients


def step_grad_norm(pl_module: L.LightningModule) -> torch.Tensor | None:
    """:func:`total_grad_norm` of ``pl_module`` at the trainer's current optimizer step, remembered
    on the module for that step (without a trainer: computed every call)."""
    trainer = pl_module._trainer
    if trainer is None:
        return total_grad_norm(pl_module)
    step = trainer.global_step
    cached = getattr(pl_module, _CACHE_ATTR, None)
    if cached is None or cached[0] != step:
        cached = (step, total_grad_norm(pl_module))
        setattr(pl_module, _CACHE_ATTR, cached)
    return cached[1]
