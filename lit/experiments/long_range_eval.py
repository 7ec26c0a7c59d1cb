"""Far-context evidence on the long-range corpus (:class:`lit.training.long_range.LongRangeData`).

- :func:`score`: loss on the copied spans against the same spans' first occurrences (their
  sources), by distance to the source, and loss by position window;
- :func:`source_recall`: per MoBA layer, the share of copied bytes whose query selects the
  chunk holding the byte's source (when that chunk is a past one), by distance and position;
- :func:`evaluate`: both, the record a sweep run keeps under ``long_range`` in its ``result.json``.

The long-range pilot (:mod:`lit.experiments.long_range_pilot`) and the sweep
(:mod:`lit.experiments.sweep`) both score through here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from flexmoba.gate import select_chunks
from lit.experiments.gate_diagnostics import Needles, capture_queries_keys, needle_hits
from lit.training.long_range import LongRangeData
from lit.training.metrics import IGNORE_INDEX, distance_bin, repeat_span_losses, scored_span_targets

SKIP = 16  # first bytes of each span not scored: a model cannot know they are copied before seeing them


def validation_sequence(data: LongRangeData, index: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs [1, S], targets [1, S])`` of validation sequence ``index``."""
    inputs, targets = data.datasets["val"][index]
    return inputs[None].to(device), targets[None]


def window_of(positions: torch.Tensor | np.ndarray, seq_len: int, windows: int):
    """Index of the position window of each position: ``windows`` equal windows of ``seq_len``."""
    return positions * windows // seq_len


def position_rows(seq_len: int, windows: int) -> list[dict]:
    span = seq_len // windows
    return [{"from": w * span, "to": (w + 1) * span} for w in range(windows)]


def bin_rows(edges: tuple[int, ...]) -> list[dict]:
    """``{"low", "high"}`` of each distance bin; the last one's high is None (no upper end)."""
    bounds = (0, *edges)
    return [{"low": low, "high": bounds[i + 1] if i + 1 < len(bounds) else None} for i, low in enumerate(bounds)]


def check_counts(sequences: int, skip: int, windows: int, seq_len: int) -> None:
    if sequences < 1:
        raise ValueError(f"sequences must be at least 1, got {sequences}")
    if skip < 0:
        raise ValueError(f"skip must be >= 0, got {skip}")
    if not 0 < windows <= seq_len:
        raise ValueError(f"windows must be in [1, seq_len={seq_len}], got {windows}")


@torch.no_grad()
def score(model, data: LongRangeData, sequences: int, skip: int = SKIP, windows: int = 8,
          device: str | torch.device = "cpu") -> dict:
    """Repeat-span losses and per-window loss over the first ``sequences`` validation sequences.

    ``model``: ``tokens [1, S] -> logits [1, S, V]``. Returns ``{"copy", "source", "gap", "count",
    "bins": [{"low", "high", "copy", "source", "gap", "count"}], "by_position": [{"from", "to",
    "loss"}], "sequences", "skip", "seq_len"}`` (gap = source - copy, nats per byte).
    """
    check_counts(sequences, skip, windows, data.seq_len)
    n = min(sequences, len(data.datasets["val"]))
    edges = tuple(data.plan.distances)  # the corpus's own bins
    total, window_sum, window_count = None, torch.zeros(windows), torch.zeros(windows)
    for i in range(n):
        inputs, targets = validation_sequence(data, i, device)
        logits = model(inputs).float().cpu()
        token_loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none",
                                     ignore_index=IGNORE_INDEX).view_as(targets)
        part = repeat_span_losses(token_loss, targets, [data.repeats_of("val", i)], edges=edges, skip=skip)
        total = part if total is None else total + part
        valid = (targets[0] != IGNORE_INDEX).float()
        window = window_of(torch.arange(targets.shape[1]), targets.shape[1], windows)
        window_sum.index_add_(0, window, token_loss[0] * valid)
        window_count.index_add_(0, window, valid)
    means = total.means()
    means["bins"] = [{"low": low, "high": high, **row} for (low, high), row in means["bins"].items()]
    means["by_position"] = [{**row, "loss": float(window_sum[w] / window_count[w])}
                            for w, row in enumerate(position_rows(data.seq_len, windows))]
    means["sequences"], means["skip"], means["seq_len"] = n, skip, data.seq_len
    return means


@dataclass
class CopyQueries:
    """Copied bytes of one sequence whose source lies in a past chunk of the query.

    Attributes:
        queries: ``[n]`` target (= query) positions t of the copied bytes.
        sources: ``[n]`` positions s = t - (start - source) of their sources' counterparts.
        bins: ``[n]`` distance bin of each byte's span.
        chance: ``[n]`` probability that a router picking its past chunks at random selects the
            source's chunk: ``min(1, (top_k - 1) / past chunks of the query)``.
    """

    queries: np.ndarray
    sources: np.ndarray
    bins: np.ndarray
    chance: np.ndarray


def copy_queries(spans: np.ndarray, valid: np.ndarray, skip: int, edges: tuple[int, ...], chunk_size: int,
                 top_k: int) -> CopyQueries:
    """The copied bytes of one sequence (``spans: [r, 3]``, ``valid: [S]`` bool targets), scored as
    :func:`lit.training.metrics.repeat_span_losses` scores them, whose source is in a past chunk."""
    parts = list(scored_span_targets(spans, valid, skip))
    empty = [np.zeros(0, dtype=np.int64)]
    queries = np.concatenate([t for t, _, _ in parts] or empty)
    sources = np.concatenate([s for _, s, _ in parts] or empty)
    bins = np.concatenate([np.full(len(t), distance_bin(edges, d)) for t, _, d in parts] or empty)
    past = sources // chunk_size < queries // chunk_size
    queries, sources, bins = queries[past], sources[past], bins[past]
    chance = np.minimum(1.0, (top_k - 1) / np.maximum(queries // chunk_size, 1))
    return CopyQueries(queries, sources, bins, chance)


@dataclass
class GroupSums:
    """Gate hits summed over the copied bytes of each group (distance bin or position window).

    ``hits, in_chunk: [n_groups, n_layers]``: per byte the share of heads whose query selects the
    source's chunk (``in_chunk``: whose query or an earlier one of its chunk does), summed;
    ``pairs, chance: [n_groups]``: bytes, and their chances of a hit summed.
    """

    hits: np.ndarray
    in_chunk: np.ndarray
    pairs: np.ndarray
    chance: np.ndarray

    @classmethod
    def zeros(cls, n_groups: int, n_layers: int) -> GroupSums:
        return cls(np.zeros((n_groups, n_layers)), np.zeros((n_groups, n_layers)), np.zeros(n_groups),
                   np.zeros(n_groups))

    def add(self, group: int, hits: np.ndarray, in_chunk: np.ndarray, found: CopyQueries) -> None:
        """Add the bytes ``found`` of ``group``; ``hits, in_chunk: [n_layers]``, their means over bytes and heads."""
        n = len(found.queries)
        self.hits[group] += hits * n
        self.in_chunk[group] += in_chunk * n
        self.pairs[group] += n
        self.chance[group] += found.chance.sum()

    def rows(self) -> list[dict]:
        """Per group: ``{"pairs", "recall" (mean over layers), "recall_by_layer", "in_chunk_by_layer",
        "chance"}``; NaN where no byte was scored."""
        with np.errstate(invalid="ignore", divide="ignore"):
            recall, near = self.hits / self.pairs[:, None], self.in_chunk / self.pairs[:, None]
            chance = self.chance / self.pairs
        return [{"pairs": int(self.pairs[g]), "recall": float(recall[g].mean()), "recall_by_layer": recall[g].tolist(),
                 "in_chunk_by_layer": near[g].tolist(), "chance": float(chance[g])} for g in range(len(self.pairs))]


def moba_layers(model) -> list[int]:
    """Layers the model's config makes MoBA (a hybrid's too, after its switch to full attention)."""
    return [i for i, kind in enumerate(model.config.layer_attention()) if kind == "moba"]


@torch.no_grad()
def source_recall(model, data: LongRangeData, sequences: int, skip: int = SKIP, windows: int = 8,
                  device: str | torch.device = "cpu") -> dict | None:
    """MoBA's gate recall on the copied bytes of the first ``sequences`` validation sequences.

    For a copied byte at target position t whose source counterpart s lies in a past chunk, a hit
    is the query at t selecting (:func:`flexmoba.gate.select_chunks` with the model's MoBA spec)
    the chunk holding s. Every layer the config makes MoBA is scored, whatever attention it runs
    now (a hybrid ends in full attention; its gate is still defined from its q and k). None for a
    model without MoBA layers. Returns ``{"chunk_size", "top_k", "layers", "attention_now",
    "pairs", "recall", "recall_by_layer", "chance", "bins": [{"low", "high", "pairs", "recall",
    "recall_by_layer", "in_chunk_by_layer", "chance"}], "by_position": [{"from", "to", ...}]}``.
    """
    check_counts(sequences, skip, windows, data.seq_len)
    layers = moba_layers(model)
    if not layers:
        return None
    spec = model.config.moba
    edges = tuple(data.plan.distances)
    by_bin, by_window = GroupSums.zeros(len(edges) + 1, len(layers)), GroupSums.zeros(windows, len(layers))
    n = min(sequences, len(data.datasets["val"]))
    for i in range(n):
        inputs, targets = validation_sequence(data, i, device)
        captured = capture_queries_keys(model, inputs)
        selections = [select_chunks(*captured[layer], spec) for layer in layers]
        found = copy_queries(data.repeats_of("val", i), (targets[0] != IGNORE_INDEX).numpy(), skip, edges,
                             spec.chunk_size, spec.top_k)
        add_sequence(by_bin, by_window, selections, found, window_of(found.queries, data.seq_len, windows))
    pairs = by_bin.pairs.sum()
    by_layer = by_bin.hits.sum(0) / pairs if pairs else np.full(len(layers), np.nan)
    return {"chunk_size": spec.chunk_size, "top_k": spec.top_k, "layers": layers,
            "attention_now": [model.layer_attention()[layer] for layer in layers], "pairs": int(pairs),
            "recall": float(by_layer.mean()), "recall_by_layer": by_layer.tolist(),
            "chance": float(by_bin.chance.sum() / pairs) if pairs else float("nan"),
            "bins": [{**b, **row} for b, row in zip(bin_rows(edges), by_bin.rows(), strict=True)],
            "by_position": [{**w, **row} for w, row in
                            zip(position_rows(data.seq_len, windows), by_window.rows(), strict=True)],
            "sequences": n, "skip": skip}


def add_sequence(by_bin: GroupSums, by_window: GroupSums, selections: list, found: CopyQueries,
                 window: np.ndarray) -> None:
    """Add one sequence's bytes (``window: [n]``, their position windows): one :func:`needle_hits` call
    per layer and (distance bin, position window) group."""
    for b, w in sorted(set(zip(found.bins.tolist(), window.tolist(), strict=True))):
        keep = (found.bins == b) & (window == w)
        group = CopyQueries(*(x[keep] for x in (found.queries, found.sources, found.bins, found.chance)))
        needles = Needles(value_positions=torch.as_tensor(group.sources)[None],
                          query_positions=torch.as_tensor(group.queries)[None])
        hits = [needle_hits(selection, needles) for selection in selections]
        hit = np.array([float(h.mean()) for h, _ in hits])
        in_chunk = np.array([float(c.mean()) for _, c in hits])
        by_bin.add(b, hit, in_chunk, group)
        by_window.add(w, hit, in_chunk, group)


def evaluate(model, data: LongRangeData, sequences: int, skip: int = SKIP, windows: int = 8,
             device: str | torch.device = "cpu") -> dict:
    """:func:`score`, with :func:`source_recall` under ``"gate"`` for a model with MoBA layers."""
    result = score(model, data, sequences, skip, windows, device)
    gate = source_recall(model, data, sequences, skip, windows, device)
    return result if gate is None else {**result, "gate": gate}
