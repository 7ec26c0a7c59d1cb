"""LightningModule: causal LM training of :class:`flexmoba.model.GPT`."""

from __future__ import annotations

import dataclasses
import math

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ThroughputMonitor
from torch.utils.checkpoint import checkpoint

from flexmoba.checkpoint import model_weights, read_checkpoint
from flexmoba.model import GPT, ModelConfig
from lit.training import metric_names as names
from lit.training.context_parallel import MESH_DIMS, context_parallel_group, gather_positions, group_sum
from lit.training.grad_norm import step_grad_norm
from lit.training.metrics import IGNORE_INDEX, EvalCounts, TokenMeanLoss, WindowedLoss, position_windows
from lit.training.metrics import trailing_window as trailing_positions
from lit.training.throughput import ModelFlopsThroughput


def checkpointed(forward):
    """``forward`` that keeps no activations: they are recomputed in the backward."""
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return run


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup to 1, then cosine decay to ``min_lr_ratio`` at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_stable_decay(step: int, warmup_steps: int, total_steps: int, decay_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup to 1, constant, then linear decay over the last ``decay_steps`` steps to
    ``min_lr_ratio`` at ``total_steps`` (Hu et al. 2024). A run without decay (``decay_steps`` 0) resumed with
    another ``total_steps`` and ``decay_steps`` is one branch of a shared trunk: the stable phase does not
    depend on where the run ends."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_start = total_steps - decay_steps
    if decay_steps == 0 or step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start + 1) / decay_steps)
    return 1.0 - (1 - min_lr_ratio) * progress


class LitLM(L.LightningModule):
    """Causal language modelling with windowed validation losses.

    Args:
        config: the model architecture; default: the default model, ``ModelConfig()``.
        seq_len: training sequence length (linked from the data by the CLI); sizes the
            position windows.
        lr, weight_decay, betas: AdamW (decay on matrices only).
        warmup_steps: linear warmup steps; then cosine decay to ``min_lr_ratio * lr``.
        lr_decay_steps: where the cosine ends; default: the trainer's last step. Set it to
            stop a run early on the same schedule as a longer one.
        wsd_decay_steps: instead of the cosine, warmup-stable-decay: the lr stays constant after the
            warmup until the last ``wsd_decay_steps`` steps of the run, which decay it linearly to
            ``min_lr_ratio * lr`` (0: no decay, a trunk that branches resume with their own decay).
        position_window: width of the loss-by-position windows.
        trailing_window: the last W positions, reported as ``<stage>/loss_trailing``.
        activation_checkpointing: recompute each block's activations in the backward
            instead of keeping them (less memory, about one more forward of compute).
        compile: ``torch.compile`` the whole model (after FSDP2 sharding, if any).
        init_from: a flexmoba checkpoint whose weights the model starts from (``flexmoba import-hf``'s
            ``model.ckpt``, or another run's): continued training of a pretrained model. Its
            architecture must equal ``config``'s (checked when the command line is parsed); the
            attention (``attention``, ``moba``, ``full_attention_last_n_layers``) may differ.
    """

    def __init__(
        self,
        config: ModelConfig | None = None,
        seq_len: int = 1024,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 100,
        min_lr_ratio: float = 0.1,
        lr_decay_steps: int | None = None,
        wsd_decay_steps: int | None = None,
        position_window: int = 256,
        trailing_window: int = 256,
        activation_checkpointing: bool = False,
        compile: bool = False,
        init_from: str | None = None,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.config = ModelConfig(**config) if isinstance(config, dict) else config or ModelConfig()
        # Plain data, so that checkpoints load with torch.load(weights_only=True).
        self.hparams["config"] = dataclasses.asdict(self.config)
        self.model = GPT(self.config)
        if init_from is not None:
            self.model.load_state_dict(model_weights(read_checkpoint(init_from)))
        self.seq_len = seq_len
        self.windows = position_windows(seq_len, position_window)
        self.metrics = torch.nn.ModuleDict()
        for stage in ("val", "test"):
            self.metrics[f"{stage}_loss"] = TokenMeanLoss()
            self.metrics[f"{stage}_windows"] = WindowedLoss(self.windows)
            self.metrics[f"{stage}_trailing"] = WindowedLoss(trailing_positions(seq_len, trailing_window))
            self.metrics[f"{stage}_counts"] = EvalCounts()  # what ran: reports count it, not the limit
        self.batch_shape = (0, seq_len)  # [B, S] of the latest batch, for flops_per_batch
        self._flops_per_batch: dict[tuple, float] = {}

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def token_losses(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-target cross-entropy ``[B, S]`` (0 where ignored) and the targets ``[B, S]``."""
        inputs, targets = batch
        self.batch_shape = tuple(inputs.shape)
        logits = self.model(inputs)
        loss = F.cross_entropy(
            logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
        )
        return loss.view_as(targets), targets

    # -- training -----------------------------------------------------------------------

    def training_step(self, batch, batch_idx):
        token_loss, targets = self.token_losses(batch)
        cp = self.model.context_parallel
        n_tokens = group_sum((targets != IGNORE_INDEX).sum(), cp).clamp(min=1)  # of the whole sequences
        loss = token_loss.sum() / n_tokens  # this rank's share of its group's mean
        # The whole batch's loss on every mesh (data-parallel groups averaged), not this rank's share.
        on_mesh = self.device_mesh is not None and self.device_mesh.mesh_dim_names == MESH_DIMS
        self.log(names.loss("train"), group_sum(loss, cp), prog_bar=True, sync_dist=on_mesh)
        if cp is not None:
            loss = loss * cp.size  # FSDP2 averages the gradients over every rank, context-parallel ones too
        self.log(names.learning_rate("train"), self.trainer.optimizers[0].param_groups[0]["lr"])
        self.log(names.moba_layers("train"), float(self.model.layer_attention().count("moba")))
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        """Log the total gradient norm before clipping (gradients are already reduced across processes);
        computed once a step, shared with the divergence guard, never read here on the host."""
        norm = step_grad_norm(self)
        if norm is not None:
            self.log(names.grad_norm("train"), norm)

    # -- throughput ---------------------------------------------------------------------

    @property
    def flops_per_batch(self) -> float:
        """FLOPs of the latest batch on this device by the model's count (forward and backward when
        training, forward only otherwise), remembered per batch shape, stage and layer kinds;
        the throughput monitor turns it into FLOP/s and MFU."""
        cp = self.model.context_parallel
        ranks = 1 if cp is None else cp.size
        key = (self.batch_shape, self.trainer.training, tuple(self.model.layer_attention()), ranks)
        if key not in self._flops_per_batch:
            (batch, seq_len), training, kinds, _ = key
            per_token = self.config.flops_per_token(seq_len * ranks, list(kinds), training=training)
            self._flops_per_batch[key] = per_token * batch * seq_len  # this rank's share of whole sequences
        return self._flops_per_batch[key]

    def configure_callbacks(self) -> list[L.Callback]:
        """Throughput and MFU (see lit/training/throughput.py), unless the trainer has a ThroughputMonitor already."""
        if any(isinstance(callback, ThroughputMonitor) for callback in self.trainer.callbacks):
            return []
        return [ModelFlopsThroughput()]  # measured at each log step, rates since the previous one

    # -- evaluation ---------------------------------------------------------------------

    def _eval_step(self, batch, stage: str) -> None:
        token_loss, targets = self.token_losses(batch)
        cp = self.model.context_parallel
        if cp is not None:  # whole sequences, counted once: by the group's first rank
            token_loss, targets = gather_positions(token_loss, cp), gather_positions(targets, cp)
            if cp.rank != 0:
                return
        self.metrics[f"{stage}_loss"].update(token_loss, targets)
        self.metrics[f"{stage}_windows"].update(token_loss, targets)
        self.metrics[f"{stage}_trailing"].update(token_loss, targets)
        self.metrics[f"{stage}_counts"].update(targets)

    def _log_eval(self, stage: str) -> None:
        loss = self.metrics[f"{stage}_loss"].compute()
        self.log(names.loss(stage), loss, prog_bar=True, sync_dist=True)
        self.log(names.perplexity(stage), torch.exp(loss), sync_dist=True)
        self.log(names.bits_per_byte(stage), loss / math.log(2) / self.bytes_per_token(stage), sync_dist=True)
        windows = self.metrics[f"{stage}_windows"]
        losses, reached = windows.compute().reshape(-1), windows.reached()
        for (start, end), value, counted in zip(self.windows, losses, reached, strict=True):
            if counted:
                self.log(names.position_loss(stage, start, end), value.float(), sync_dist=True)
        trailing = self.metrics[f"{stage}_trailing"]
        if trailing.reached()[0]:
            self.log(names.trailing_loss(stage), trailing.compute().reshape(-1)[0].float(), sync_dist=True)
        counts = self.metrics[f"{stage}_counts"].compute()  # every process's, summed
        for what, count in zip(names.EVAL_COUNTS, counts, strict=True):
            self.log(names.eval_count(stage, what), count, sync_dist=True)  # the same on every process
        for name in ("loss", "windows", "trailing", "counts"):
            self.metrics[f"{stage}_{name}"].reset()

    def bytes_per_token(self, stage: str) -> float:
        """Bytes a token stands for in the data of ``stage``: the data module's count, 1 for bytes."""
        count = getattr(getattr(self._trainer, "datamodule", None), "bytes_per_token", None)
        return 1.0 if count is None else count(stage)

    def validation_step(self, batch, batch_idx) -> None:
        self._eval_step(batch, "val")

    def on_validation_epoch_end(self) -> None:
        self._log_eval("val")

    def test_step(self, batch, batch_idx) -> None:
        self._eval_step(batch, "test")

    def on_test_epoch_end(self) -> None:
        self._log_eval("test")

    def predict_step(self, batch, batch_idx) -> dict[str, torch.Tensor]:
        """Per-sequence mean loss ``[B]`` and a greedy 16-byte continuation of each sequence's first 32 bytes."""
        token_loss, targets = self.token_losses(batch)
        n_tokens = (targets != IGNORE_INDEX).sum(dim=1).clamp(min=1)
        prompt = batch[0][:, :32]
        return {"loss": token_loss.sum(dim=1) / n_tokens, "continuation": self.model.generate(prompt, 16)[:, 32:]}

    # -- sharding -----------------------------------------------------------------------

    def configure_model(self) -> None:
        """Once (Lightning calls it for every stage): activation checkpointing per block if asked,
        FSDP2 sharding under ``ModelParallelStrategy``, then ``torch.compile`` if asked."""
        if getattr(self, "_model_configured", False):
            return
        self._model_configured = True
        if self.hparams.get("activation_checkpointing"):
            for block in self.model.blocks:
                block.forward = checkpointed(block.forward)  # keeps parameter names, unlike a wrapper module
        self.shard_fsdp2()
        if self.hparams.get("compile"):
            self.model.compile()  # in place: parameter names (and checkpoints) stay those of the plain model

    def shard_fsdp2(self) -> None:
        """Under ``ModelParallelStrategy`` (``configs/fsdp2.yaml``), shard the model with FSDP2:
        ``fully_shard`` each block, then the root (embeddings, final norm, head). No-op otherwise.

        Under ``ContextParallelStrategy`` (``configs/cp2.yaml``) the shards span every rank (the
        flattened data x context mesh), and the model splits each sequence over its group."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        mesh = self.device_mesh
        if mesh is None or isinstance(self.model, FSDPModule):  # not model parallel, or sharded already
            return
        if mesh.mesh_dim_names == MESH_DIMS:
            self.model.set_context_parallel(context_parallel_group(mesh))
            data_mesh = mesh._flatten("data_context_parallel")
            for block in self.model.blocks:
                fully_shard(block, mesh=data_mesh)
            fully_shard(self.model, mesh=data_mesh)
            return
        if mesh["tensor_parallel"].size() != 1:
            raise ValueError(f"FSDP2 shards over data parallelism only: set the strategy's tensor_parallel_size: 1 "
                             f"and data_parallel_size to the number of processes ({mesh.size()})")
        data_mesh = mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=data_mesh)
        fully_shard(self.model, mesh=data_mesh)

    # -- optimizer ----------------------------------------------------------------------

    def configure_optimizers(self):
        hp = self.hparams
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp.lr, betas=tuple(hp.betas),
        )
        total_steps = hp.lr_decay_steps or max(1, int(self.trainer.estimated_stepping_batches))
        warmup = max(1, min(hp.warmup_steps, total_steps))
        if hp.get("wsd_decay_steps") is None:
            def multiplier(step):
                return warmup_cosine(step, warmup, total_steps, hp.min_lr_ratio)
        else:
            def multiplier(step):
                return warmup_stable_decay(step, warmup, total_steps, hp.wsd_decay_steps, hp.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # -- bookkeeping --------------------------------------------------------------------

    def on_fit_start(self) -> None:
        cfg = self.config
        flops = {
            names.PARAMS_NON_EMBEDDING: float(self.model.num_parameters(non_embedding=True)),
            names.PARAMS_TOTAL: float(self.model.num_parameters(non_embedding=False)),
            names.DENSE_FLOPS_PER_TOKEN: float(cfg.dense_flops_per_token()),
            names.ATTENTION_FLOPS_PER_TOKEN: float(cfg.attention_flops_per_token(self.seq_len)),
        }
        for logger in self.loggers:
            logger.log_metrics(flops, step=0)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # A phase switch to full attention must survive validate/test/resume from this checkpoint.
        checkpoint["attention_override"] = self.model.attention_override

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.model.set_attention_override(checkpoint.get("attention_override"))
