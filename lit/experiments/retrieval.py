"""Synthetic long-context retrieval: multi-query associative recall over byte tokens.

A sequence of ``L + 1`` bytes (inputs are the first L, targets the last L)::

    filler ... | K1 v1 ␠ K2 v2 ␠ ... Kn vn ␠ | filler ... | ␠ Ka va ␠ Kb vb ... (end)
               ^ pairs, starting at ``depth`` of the room left     ^ queries, flush with the end

- keys: ``key_len`` upper-case letters, distinct within a sequence;
- values: ``value_len`` digits;
- filler: random lower-case letters, so no key or value byte occurs in it;
- queries: ``n_queries`` of the keys, each followed by its value.

Only the value bytes after a query key are targets (every other target is IGNORE_INDEX):
the loss is exactly the retrieval loss, and filler, which is unpredictable noise, adds no
gradient. A query is *answered* when every value byte is the argmax under teacher forcing
(with ``value_len=1`` that is greedy generation). Answering needs an induction-style lookup
from the end of the sequence back to the pair block, ``distance`` tokens away; MoBA's router
must select the chunk holding the pair for that.

    flexmoba retrieval evaluate --ckpt runs/retrieval-moba/checkpoints/last.ckpt --out out/retrieval/moba
"""
# The command's options and its main are lit.experiments.retrieval_evaluate's: it imports this module (torch,
# Lightning) only once the job runs, so that ``flexmoba retrieval --help`` is immediate.

from __future__ import annotations

import inspect
import json
import string
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from flexmoba.checkpoint import load_model, read_checkpoint
from lit.training import figures
from lit.training.metrics import IGNORE_INDEX

KEY_BYTES = np.frombuffer(string.ascii_uppercase.encode(), dtype=np.uint8)
VALUE_BYTES = np.frombuffer(string.digits.encode(), dtype=np.uint8)
FILLER_BYTES = np.frombuffer(string.ascii_lowercase.encode(), dtype=np.uint8)
SEPARATOR = ord(" ")


@dataclass(frozen=True)
class RetrievalTask:
    """Shape of the recall problem (everything but length and depth, which vary per sample)."""

    n_pairs: int = 8
    n_queries: int = 4
    key_len: int = 1
    value_len: int = 1

    def __post_init__(self) -> None:
        for name in ("n_pairs", "n_queries", "key_len", "value_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"RetrievalTask.{name} must be positive, got {getattr(self, name)}")
        if self.n_queries > self.n_pairs:
            raise ValueError(f"n_queries={self.n_queries} must be <= n_pairs={self.n_pairs}")
        if self.n_pairs > len(KEY_BYTES) ** self.key_len:
            raise ValueError(f"n_pairs={self.n_pairs} distinct keys need a longer key_len than {self.key_len}")

    @property
    def item_len(self) -> int:
        """Bytes of one ``key value separator`` item (pairs and queries alike)."""
        return self.key_len + self.value_len + 1

    def min_length(self) -> int:
        """Shortest sequence (inputs) that holds the pairs, one filler byte and the queries."""
        return (self.n_pairs + self.n_queries) * self.item_len + 2


@dataclass
class RetrievalSample:
    """One sequence and where its answers are.

    Attributes:
        tokens: ``[L + 1]`` uint8 bytes.
        pair_start: position of the first pair's first key byte.
        key_positions: ``[n_queries]`` position of the first key byte of each queried pair.
        value_positions: ``[n_queries]`` position of that pair's first value byte (the
            token an induction head copies: the "needle").
        answer_positions: ``[n_queries, value_len]`` input positions whose *target* is a value
            byte of the answer (the token at position + 1 is that byte).
        query_positions: ``[n_queries]`` input position of each query's last key byte (the
            query that must retrieve: its target is the first value byte).
    """

    tokens: np.ndarray
    pair_start: int
    key_positions: np.ndarray
    value_positions: np.ndarray
    answer_positions: np.ndarray
    query_positions: np.ndarray

    @property
    def distances(self) -> np.ndarray:
        """``[n_queries]`` tokens from the queried pair's key to the query."""
        return self.query_positions - self.key_positions


def make_sample(task: RetrievalTask, length: int, depth: float, rng: np.random.Generator) -> RetrievalSample:
    """A sequence of ``length`` inputs with the pair block at ``depth`` in ``[0, 1]`` of the free room."""
    if length < task.min_length():
        raise ValueError(f"length={length} is below the task's minimum {task.min_length()}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    tokens = rng.choice(FILLER_BYTES, size=length + 1)
    keys = distinct_keys(task, rng)
    values = rng.choice(VALUE_BYTES, size=(task.n_pairs, task.value_len))
    pairs_len, queries_len = task.n_pairs * task.item_len, task.n_queries * task.item_len
    room = length + 1 - pairs_len - queries_len - 1  # one separator before the queries
    pair_start = int(round(depth * room))
    for i in range(task.n_pairs):
        write_item(tokens, pair_start + i * task.item_len, keys[i], values[i])
    query_start = length + 1 - queries_len
    tokens[query_start - 1] = SEPARATOR
    asked = rng.permutation(task.n_pairs)[: task.n_queries]
    for j, i in enumerate(asked):
        write_item(tokens, query_start + j * task.item_len, keys[i], values[i])
    query_keys_end = query_start + np.arange(task.n_queries) * task.item_len + task.key_len - 1
    return RetrievalSample(
        tokens=tokens,
        pair_start=pair_start,
        key_positions=pair_start + asked * task.item_len,
        value_positions=pair_start + asked * task.item_len + task.key_len,
        answer_positions=query_keys_end[:, None] + np.arange(task.value_len)[None, :],
        query_positions=query_keys_end,
    )


def distinct_keys(task: RetrievalTask, rng: np.random.Generator) -> np.ndarray:
    """``[n_pairs, key_len]`` distinct upper-case keys."""
    codes = rng.choice(len(KEY_BYTES) ** task.key_len, size=task.n_pairs, replace=False)
    digits = (codes[:, None] // len(KEY_BYTES) ** np.arange(task.key_len)[None, :]) % len(KEY_BYTES)
    return KEY_BYTES[digits]


def write_item(tokens: np.ndarray, start: int, key: np.ndarray, value: np.ndarray) -> None:
    tokens[start : start + len(key)] = key
    tokens[start + len(key) : start + len(key) + len(value)] = value
    tokens[start + len(key) + len(value)] = SEPARATOR


def to_example(sample: RetrievalSample) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs [L], targets [L])`` int64; targets are IGNORE_INDEX except at the answers."""
    tokens = torch.from_numpy(sample.tokens.astype(np.int64))
    inputs, targets = tokens[:-1], torch.full((len(tokens) - 1,), IGNORE_INDEX, dtype=torch.int64)
    answers = torch.from_numpy(sample.answer_positions.reshape(-1))
    targets[answers] = tokens[answers + 1]
    return inputs, targets


class RetrievalDataset(Dataset):
    """``size`` samples, sample ``i`` drawn from ``seed`` and ``i`` alone (deterministic, any order).

    Each sample's depth is ``depths[i % len(depths)]`` if ``depths`` is given, else uniform
    in ``depth_range``.
    """

    def __init__(self, task: RetrievalTask, length: int, size: int, seed: int,
                 depth_range: tuple[float, float] = (0.0, 1.0), depths: list[float] | None = None):
        self.task, self.length, self.size, self.seed = task, length, size, seed
        self.depth_range, self.depths = depth_range, depths

    def __len__(self) -> int:
        return self.size

    def sample(self, index: int) -> RetrievalSample:
        rng = np.random.default_rng([self.seed, self.length, index])
        if self.depths:
            depth = self.depths[index % len(self.depths)]
        else:
            depth = float(rng.uniform(*self.depth_range))
        return make_sample(self.task, self.length, depth, rng)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return to_example(self.sample(index))


class RetrievalData(L.LightningDataModule):
    """Associative-recall sequences for :class:`lit.training.module.LitLM` (see the module docstring).

    Args:
        seq_len: training length (inputs per sequence).
        batch_size: sequences per batch.
        n_pairs, n_queries, key_len, value_len: the task (:class:`RetrievalTask`).
        depth_range: training depths are uniform in it.
        train_size: samples per training epoch (fresh seeds per epoch index are not needed:
            with thousands of samples a small model sees each only a few times).
        val_size: validation samples (depths spread over ``depth_range``).
        eval_lengths, eval_depths: the grid of :func:`evaluate_retrieval` (lengths above
            ``seq_len`` test length generalisation); default lengths a quarter, half and all of
            ``seq_len``, those shorter than the task's minimum left out.
        eval_samples: samples per grid cell.
        seed: data seed; train, val and evaluation use disjoint derived seeds.
    """

    def __init__(
        self,
        seq_len: int = 512,
        batch_size: int = 16,
        n_pairs: int = 8,
        n_queries: int = 4,
        key_len: int = 1,
        value_len: int = 1,
        depth_range: tuple[float, float] = (0.0, 1.0),
        train_size: int = 20000,
        val_size: int = 64,
        eval_lengths: list[int] | None = None,
        eval_depths: list[float] | None = None,
        eval_samples: int = 32,
        num_workers: int = 0,
        seed: int = 0,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.task = RetrievalTask(n_pairs, n_queries, key_len, value_len)
        if seq_len < self.task.min_length():
            raise ValueError(f"seq_len={seq_len} is below the task's minimum {self.task.min_length()}")
        self.seq_len, self.batch_size, self.num_workers, self.seed = seq_len, batch_size, num_workers, seed
        self.depth_range = (float(depth_range[0]), float(depth_range[1]))
        self.train_size, self.val_size = train_size, val_size
        default_lengths = [n for n in (seq_len // 4, seq_len // 2) if n >= self.task.min_length()] + [seq_len]
        self.eval_lengths = list(eval_lengths or default_lengths)
        self.eval_depths = list(eval_depths or [0.0, 0.25, 0.5, 0.75, 1.0])
        self.eval_samples = eval_samples

    def dataset(self, split: str, length: int | None = None, depth: float | None = None) -> RetrievalDataset:
        """``train``/``val``/``test`` data; ``test`` at one ``(length, depth)`` grid cell."""
        length = length or self.seq_len
        if split == "train":
            return RetrievalDataset(self.task, length, self.train_size, self.seed, self.depth_range)
        if split == "val":
            depths = list(np.linspace(*self.depth_range, 8))
            return RetrievalDataset(self.task, length, self.val_size, self.seed + 1, depths=depths)
        depth = self.eval_depths[0] if depth is None else depth
        return RetrievalDataset(self.task, length, self.eval_samples, self.seed + 2, depths=[depth])

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.dataset("train"), batch_size=self.batch_size, shuffle=True, drop_last=True,
                          generator=generator, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset("val"), batch_size=self.batch_size, num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset("test", self.seq_len, self.eval_depths[-1]), batch_size=self.batch_size)

    def predict_dataloader(self) -> DataLoader:
        return self.val_dataloader()


# -- metric -------------------------------------------------------------------------------


@torch.no_grad()
def answered(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, task: RetrievalTask) -> torch.Tensor:
    """``[B, n_queries]`` bool: every value byte of a query is the argmax prediction.

    ``inputs, targets: [B, L]`` as from :func:`to_example`; ``model(inputs) -> [B, L, V]``.
    """
    predictions = model(inputs).argmax(-1)
    answer = targets != IGNORE_INDEX
    correct = (predictions == targets)[answer].view(len(inputs), task.n_queries, task.value_len)
    return correct.all(-1)


@torch.no_grad()
def evaluate_retrieval(model: torch.nn.Module, data: RetrievalData, batch_size: int | None = None) -> list[dict]:
    """Accuracy of every ``(length, depth)`` cell of the data's evaluation grid.

    Returns rows ``{"length", "depth", "accuracy", "distance", "samples"}``; ``distance`` is
    the mean tokens between the queried pair and its query.
    """
    rows = []
    device = next(model.parameters()).device
    for length in data.eval_lengths:
        for depth in data.eval_depths:
            dataset = data.dataset("test", length, depth)
            hits, distances = [], []
            for batch in DataLoader(dataset, batch_size=batch_size or data.batch_size):
                inputs, targets = (t.to(device) for t in batch)
                hits.append(answered(model, inputs, targets, data.task).float().cpu())
            distances = [dataset.sample(i).distances.mean() for i in range(len(dataset))]
            rows.append({"length": length, "depth": depth, "accuracy": float(torch.cat(hits).mean()),
                         "distance": float(np.mean(distances)), "samples": len(dataset)})
    return rows


def markdown_table(rows: list[dict], title: str = "") -> str:
    """Accuracy (%) with lengths as rows and depths as columns."""
    lengths = sorted({r["length"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    cell = {(r["length"], r["depth"]): r["accuracy"] for r in rows}
    lines = [f"### {title}", ""] if title else []
    lines.append("| length \\ depth | " + " | ".join(f"{d:.2f}" for d in depths) + " | mean |")
    lines.append("|---" * (len(depths) + 2) + "|")
    for length in lengths:
        values = [cell[(length, d)] for d in depths]
        lines.append(f"| {length} | " + " | ".join(f"{100 * v:.0f}" for v in values)
                     + f" | {100 * np.mean(values):.1f} |")
    return "\n".join(lines) + "\n"


def heatmap(rows: list[dict], path: str | Path, title: str = "") -> None:
    """The needle-in-a-haystack figure: accuracy by context length (y) and needle depth (x)."""
    lengths = sorted({r["length"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    cell = {(r["length"], r["depth"]): r["accuracy"] for r in rows}
    grid = np.array([[cell[(length, d)] for d in depths] for length in lengths])
    fig = figures.figure(1.2 * len(depths) + 2, 0.7 * len(lengths) + 1.5)
    ax = fig.subplots()
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto", origin="lower")
    for (i, j), value in np.ndenumerate(grid):
        ax.text(j, i, f"{100 * value:.0f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(depths)), [f"{d:.2f}" for d in depths])
    ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_xlabel("needle depth (position of the pairs / free room)")
    ax.set_ylabel("context length (tokens)")
    ax.set_title(title or "retrieval accuracy")
    fig.colorbar(image, ax=ax, label="accuracy")
    figures.save(fig, path, dpi=120)


def write_report(rows: list[dict], out_dir: str | Path, title: str) -> Path:
    """``retrieval.md``, ``retrieval.png`` and ``retrieval.json`` in ``out_dir``; returns the folder."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "retrieval.md").write_text(markdown_table(rows, title))
    (out / "retrieval.json").write_text(json.dumps(rows, indent=2))
    heatmap(rows, out / "retrieval.png", title)
    return out


def retrieval_data_arguments(checkpoint: dict) -> dict:
    """The ``RetrievalData`` arguments of the run that wrote ``checkpoint``: its own data module's if it
    trained on retrieval, else the task's defaults at the run's training length (e.g. a compare run,
    trained on text, evaluated on the recall task as it is)."""
    saved = {k: v for k, v in (checkpoint.get("datamodule_hyper_parameters") or {}).items() if not k.startswith("_")}
    if saved and set(saved) <= set(inspect.signature(RetrievalData).parameters):
        return saved
    seq_len = checkpoint.get("hyper_parameters", {}).get("seq_len") or saved.get("seq_len")
    return {"seq_len": seq_len} if seq_len else {}


def load_run(path: str | Path | dict, model_overrides: dict, data_overrides: dict):
    """``(GPT, RetrievalData)`` of a checkpoint (a path, or its dict; CPU, eval mode), each built with
    its overrides (``ModelConfig`` fields; ``RetrievalData`` arguments)."""
    checkpoint = read_checkpoint(path) if not isinstance(path, dict) else path
    data = RetrievalData(**{**retrieval_data_arguments(checkpoint), **data_overrides})
    return load_model(checkpoint, **model_overrides), data
