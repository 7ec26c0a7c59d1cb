"""Gate diagnostics callback: does MoBA's router pick the chunks attention needs?

On the first validation batch of each validation run, per layer and head:

- ``gate/recall_l{i}`` (and ``_h{j}``): share of full causal attention's probability mass on
  the keys MoBA's gate selects (:func:`flexmoba.diagnostics.selection_recall`), averaged over
  the queries that have more past chunks than ``top_k`` (elsewhere it is 1 by construction);
- ``gate/needle_hit_l{i}`` (and ``_h{j}``), with :class:`lit.experiments.retrieval.RetrievalData` only:
  share of answer queries whose gate selects the chunk holding the queried value;
- ``gate/needle_in_chunk_l{i}``: share of answer queries for which *some* query of their
  chunk, up to them, selects the needle's chunk (a neighbour can fetch it for them);
- ``gate/mean_distance_l{i}``: mean chunks back of the selected past chunks, whose
  histogram goes into the figure.

Every layer is gated once, with the model's own :class:`flexmoba.MobaSpec` (chunk size, top-k,
granularity), full-attention layers too: there it says what MoBA's router *would* select. The figure is written to
``<run>/diagnostics/gate_step{step}.png`` (``<run>`` is the first logger's folder, else the
trainer's ``default_root_dir``).

    flexmoba fit --config configs/moba.yaml --trainer.callbacks+=lit.experiments.gate_diagnostics.GateDiagnostics
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import numpy as np
import torch

from flexmoba.diagnostics import distance_histogram, selection_recall, selects_position
from flexmoba.gate import select_chunks
from flexmoba.layout import chunk_layout
from flexmoba.model import GPT, capture_attention_inputs
from lit.training import figures


@dataclass
class LayerGateStats:
    """Diagnostics of one layer.

    Attributes:
        kind: the layer's attention (``"moba"`` or ``"full"``).
        recall: ``[H]`` mean gate recall per head over non-trivial queries.
        recall_by_position: ``[S]`` gate recall per position, mean over batch and heads.
        distances: ``[n_chunks]`` selection-distance counts (index 0 unused).
        needle_hit: ``[H]`` share of answer queries selecting the needle's chunk, or None.
        needle_in_chunk: ``[H]`` share of answer queries some query of whose chunk (up to
            the answer query) selects the needle's chunk, or None.
    """

    kind: str
    recall: torch.Tensor
    recall_by_position: torch.Tensor
    distances: torch.Tensor
    needle_hit: torch.Tensor | None = None
    needle_in_chunk: torch.Tensor | None = None

    def scalars(self, layer: int) -> dict[str, float]:
        out = {f"gate/recall_l{layer}": float(self.recall.mean())}
        out |= {f"gate/recall_l{layer}_h{h}": float(r) for h, r in enumerate(self.recall)}
        counts = self.distances.float()
        if counts.sum() > 0:
            out[f"gate/mean_distance_l{layer}"] = float((counts * torch.arange(len(counts))).sum() / counts.sum())
        if self.needle_hit is not None:
            out[f"gate/needle_hit_l{layer}"] = float(self.needle_hit.mean())
            out |= {f"gate/needle_hit_l{layer}_h{h}": float(r) for h, r in enumerate(self.needle_hit)}
            out[f"gate/needle_in_chunk_l{layer}"] = float(self.needle_in_chunk.mean())
        return out


@dataclass
class Needles:
    """Answer queries of a retrieval batch: ``value_positions, query_positions: [B, n_queries]``."""

    value_positions: torch.Tensor
    query_positions: torch.Tensor


def capture_queries_keys(model: GPT, tokens: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(q [B, H, S, D], k [B, H_kv, S, D])`` after RoPE, as attention sees them."""
    return [(q, k) for q, k, _ in capture_attention_inputs(model, tokens)]


def needle_hits(selection, needles: Needles) -> tuple[torch.Tensor, torch.Tensor]:
    """``([H], [H])``: share of (sequence, query) pairs whose answer query selects its value's
    chunk, and share where *some* query of the answer query's chunk, up to it, does.

    The second counts routes through a neighbour: a token that fetched the needle in this
    layer can hand it to the answer query inside their shared chunk in the next layer.
    """
    device = selection.past_chunks.device
    chunk_size = selection.layout.chunk_size
    positions = torch.arange(selection.past_chunks.shape[2], device=device)
    answer_hits, chunk_hits = [], []
    for j in range(needles.value_positions.shape[1]):
        selected = selects_position(selection, needles.value_positions[:, j].to(device))  # [B, H, S]
        query = needles.query_positions[:, j].to(device)  # [B]
        index = query.view(-1, 1, 1).expand(-1, selected.shape[1], 1)
        answer_hits.append(selected.gather(-1, index)[..., 0].float())  # [B, H]
        own_chunk = (positions[None] <= query[:, None]) & (positions[None] >= query[:, None] // chunk_size * chunk_size)
        chunk_hits.append((selected & own_chunk[:, None]).any(-1).float())  # [B, H]
    return torch.stack(answer_hits).mean(dim=(0, 1)), torch.stack(chunk_hits).mean(dim=(0, 1))


@torch.no_grad()
@torch.no_grad()
def gate_stats(model: GPT, tokens: torch.Tensor, needles: Needles | None = None) -> list[LayerGateStats]:
    """Diagnostics of every layer of ``model`` on ``tokens: [B, S]``: one gate call per layer, with the
    model's own MoBA spec; recall, distances and needle hits all read that selection."""
    spec = model.config.moba
    nontrivial = torch.arange(tokens.shape[1], device=tokens.device) >= spec.chunk_size * spec.top_k
    layout = chunk_layout(*tokens.shape, spec.chunk_size, tokens.device)  # one for all layers
    stats = []
    for kind, (q, k) in zip(model.layer_attention(), capture_queries_keys(model, tokens), strict=True):
        selection = select_chunks(q, k, spec, layout=layout)
        recall = selection_recall(q, k, selection)  # [B, H, S]
        per_head = recall[..., nontrivial].mean(dim=(0, 2)) if nontrivial.any() else recall.mean(dim=(0, 2))
        stats.append(LayerGateStats(
            kind=kind,
            recall=per_head.cpu(),
            recall_by_position=recall.mean(dim=(0, 1)).cpu(),
            distances=distance_histogram(selection).cpu(),
        ))
        if needles is not None:
            stats[-1].needle_hit, stats[-1].needle_in_chunk = (h.cpu() for h in needle_hits(selection, needles))
    return stats


def plot_gate_stats(stats: list[LayerGateStats], path: str | Path, title: str = "") -> None:
    """One PNG: recall per layer x head, needle hits per layer x head, distance histograms."""
    has_needles = stats[0].needle_hit is not None
    panels = 3 + 2 * has_needles
    fig = figures.figure(4.2 * panels, 3.6)
    axes = fig.subplots(1, panels)
    labels = [f"L{i} {s.kind}" for i, s in enumerate(stats)]
    heat_panels = [("gate recall", torch.stack([s.recall for s in stats]))]
    if has_needles:
        heat_panels.append(("needle chunk selected by answer query", torch.stack([s.needle_hit for s in stats])))
        heat_panels.append(("... by a query of its chunk", torch.stack([s.needle_in_chunk for s in stats])))
    for ax, (name, grid) in zip(axes, heat_panels, strict=False):
        image = ax.imshow(grid.numpy(), vmin=0, vmax=1, cmap="viridis", aspect="auto")
        for (i, j), value in np.ndenumerate(grid.numpy()):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", color="w", fontsize=8)
        ax.set_yticks(range(len(labels)), labels)
        ax.set_xticks(range(grid.shape[1]))
        ax.set_xlabel("head")
        ax.set_title(name)
        fig.colorbar(image, ax=ax)
    ax = axes[len(heat_panels)]
    for label, s in zip(labels, stats, strict=True):
        ax.plot(s.recall_by_position.numpy(), label=label)
    ax.set_xlabel("query position")
    ax.set_ylabel("gate recall")
    ax.set_ylim(0, 1.02)
    ax.set_title("recall by position")
    ax.legend(fontsize=7)
    ax = axes[-1]
    for label, s in zip(labels, stats, strict=True):
        counts = s.distances.float()
        share = counts / counts.sum().clamp(min=1)
        ax.plot(range(1, len(share)), share[1:].numpy(), marker="o", label=label)
    ax.set_xticks(range(1, len(stats[0].distances)))
    ax.set_xlabel("chunks back (1 = previous chunk)")
    ax.set_ylabel("share of selected past chunks")
    ax.set_title("selection distance")
    ax.legend(fontsize=7)
    fig.suptitle(title)
    figures.save(fig, path)


def run_folder(trainer: L.Trainer) -> Path:
    for logger in trainer.loggers:
        if getattr(logger, "log_dir", None):
            return Path(logger.log_dir)
    return Path(trainer.default_root_dir or os.getcwd())


@dataclass
class _Pending:
    tokens: torch.Tensor | None = None
    needles: Needles | None = None


class GateDiagnostics(L.Callback):
    """Log gate diagnostics on the first validation batch (see the module docstring).

    Args:
        max_sequences: rows of that batch used (gate recall materialises ``[B, H, S, S]``).
        plot: write the PNG summary.
    """

    def __init__(self, max_sequences: int = 8, plot: bool = True):
        self.max_sequences = max_sequences
        self.plot = plot
        self._pending = _Pending()
        self.last_stats: list[LayerGateStats] | None = None

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if batch_idx == 0 and dataloader_idx == 0 and not trainer.sanity_checking:
            self._pending.tokens = batch[0][: self.max_sequences]
            self._pending.needles = retrieval_needles(trainer, len(self._pending.tokens))

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        tokens, needles = self._pending.tokens, self._pending.needles
        self._pending = _Pending()
        if tokens is None:
            return
        was_training = pl_module.model.training
        pl_module.model.eval()
        try:
            self.last_stats = gate_stats(pl_module.model, tokens, needles)
        finally:
            pl_module.model.train(was_training)
        scalars = {k: v for i, s in enumerate(self.last_stats) for k, v in s.scalars(i).items()}
        pl_module.log_dict(scalars)
        if self.plot and trainer.is_global_zero:
            folder = run_folder(trainer) / "diagnostics"
            folder.mkdir(parents=True, exist_ok=True)
            cfg = pl_module.config
            title = f"step {trainer.global_step}: chunk {cfg.moba.chunk_size}, top-{cfg.moba.top_k}"
            plot_gate_stats(self.last_stats, folder / f"gate_step{trainer.global_step:06d}.png", title)


def retrieval_needles(trainer: L.Trainer, rows: int) -> Needles | None:
    """Needle positions of the first ``rows`` validation sequences, if the data is RetrievalData.

    The validation loader is unshuffled, so batch row ``i`` is dataset sample ``i``.
    """
    from lit.experiments.retrieval import RetrievalData

    data = getattr(trainer, "datamodule", None)
    if not isinstance(data, RetrievalData):
        return None
    dataset = data.dataset("val")
    samples = [dataset.sample(i) for i in range(rows)]
    return Needles(
        value_positions=torch.as_tensor(np.stack([s.value_positions for s in samples])),
        query_positions=torch.as_tensor(np.stack([s.query_positions for s in samples])),
    )
