"""Byte-level corpus of Python source files (default: this interpreter's standard library).

- Documents are ``.py`` files under ``corpus_dir``; ``site-packages`` is skipped.
- Tokens are raw bytes (vocabulary 256).
- Train/val/test split by a hash of each file's relative path: stable across machines
  and across ``max_files``/``max_bytes`` slices.
- Training sequences are ``seq_len + 1`` tokens cut from one document (never across a
  document boundary), so "position t" really means "t tokens into a file".
- The tokenized splits are cached under ``cache_dir`` keyed by a fingerprint of the file
  list, sizes, Python version and slicing options.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import sysconfig
from pathlib import Path

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lit.metrics import IGNORE_INDEX

VOCAB_SIZE = 256
PAD_TOKEN = 0  # input filler after a short document ends; its targets are IGNORE_INDEX
SPLITS = ("train", "val", "test")
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def default_corpus_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def default_cache_dir() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "flexmoba")


def list_python_files(corpus_dir: str) -> list[tuple[str, int]]:
    """Sorted ``(relative path, size in bytes)`` of the ``.py`` files under ``corpus_dir``."""
    root = Path(corpus_dir)
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                if path.is_file():
                    files.append((path.relative_to(root).as_posix(), path.stat().st_size))
    return sorted(files)


def path_hash(relative_path: str) -> float:
    """A stable number in ``[0, 1)`` for a relative path."""
    digest = hashlib.sha1(relative_path.encode()).hexdigest()
    return int(digest[:12], 16) / 16**12


def split_of(relative_path: str, val_fraction: float, test_fraction: float) -> str:
    h = path_hash(relative_path)
    if h < val_fraction:
        return "val"
    if h < val_fraction + test_fraction:
        return "test"
    return "train"


def select_files(
    files: list[tuple[str, int]],
    *,
    val_fraction: float,
    test_fraction: float,
    min_doc_bytes: int,
    max_files: int | None,
    max_bytes: int | None,
) -> dict[str, list[tuple[str, int]]]:
    """Split ``files`` and optionally slice each split (in path-hash order, so deterministic).

    ``max_files``/``max_bytes`` bound the training split; val and test get the same fraction
    of that budget as of the corpus, but always at least one file each.
    """
    by_split: dict[str, list[tuple[str, int]]] = {s: [] for s in SPLITS}
    for rel, size in sorted(files, key=lambda f: path_hash(f[0])):
        if size >= min_doc_bytes:
            by_split[split_of(rel, val_fraction, test_fraction)].append((rel, size))
    fractions = {"train": 1.0, "val": val_fraction, "test": test_fraction}
    if max_files is None and max_bytes is None:
        return {s: sorted(fs) for s, fs in by_split.items()}
    train_share = max(1e-9, 1.0 - val_fraction - test_fraction)
    selected = {}
    for split, split_files in by_split.items():
        share = 1.0 if split == "train" else fractions[split] / train_share
        file_cap = None if max_files is None else max(1, math.ceil(max_files * share))
        byte_cap = None if max_bytes is None else max_bytes * share
        chosen, n_bytes = [], 0
        for rel, size in split_files:
            if file_cap is not None and len(chosen) >= file_cap:
                break
            if byte_cap is not None and chosen and n_bytes + size > byte_cap:
                break
            chosen.append((rel, size))
            n_bytes += size
        selected[split] = sorted(chosen)
    return selected


def corpus_fingerprint(selected: dict[str, list[tuple[str, int]]], **options) -> str:
    """Hash of the selected files (paths and sizes), the Python version and slicing options."""
    payload = {
        "python": sys.version,
        "options": options,
        "files": {split: [[rel, size] for rel, size in files] for split, files in selected.items()},
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def read_documents(corpus_dir: str, files: list[tuple[str, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated bytes ``[n_tokens]`` uint8 and document offsets ``[n_docs + 1]`` int64."""
    chunks, offsets = [], [0]
    for rel, _ in files:
        data = (Path(corpus_dir) / rel).read_bytes()
        chunks.append(np.frombuffer(data, dtype=np.uint8))
        offsets.append(offsets[-1] + len(data))
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint8)
    return tokens, np.asarray(offsets, dtype=np.int64)


def sequence_starts(offsets: np.ndarray, seq_len: int, pad_short_docs: bool) -> tuple[np.ndarray, np.ndarray]:
    """Start token and token count (``<= seq_len + 1``) of every sequence cut from the documents.

    A document of L tokens gives ``(L - 1) // seq_len`` full sequences (consecutive
    sequences share one token: the last target of one is the first input of the next). With
    ``pad_short_docs`` the leftover tail, or a whole document shorter than ``seq_len + 1``,
    becomes one more sequence, padded later.
    """
    starts, lengths = [], []
    for begin, end in zip(offsets[:-1], offsets[1:], strict=True):
        n_full = max(0, (end - begin - 1) // seq_len)
        for i in range(n_full):
            starts.append(begin + i * seq_len)
            lengths.append(seq_len + 1)
        tail = end - (begin + n_full * seq_len)
        if pad_short_docs and tail >= 2:
            starts.append(begin + n_full * seq_len)
            lengths.append(tail)
    return np.asarray(starts, dtype=np.int64), np.asarray(lengths, dtype=np.int64)


class ByteSequences(Dataset):
    """``(inputs, targets)``, each ``[seq_len]`` int64; padded targets are ``IGNORE_INDEX``."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, seq_len: int, pad_short_docs: bool):
        self.tokens = tokens
        self.seq_len = seq_len
        self.starts, self.lengths = sequence_starts(offsets, seq_len, pad_short_docs)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start, length = int(self.starts[index]), int(self.lengths[index])
        window = torch.from_numpy(self.tokens[start : start + length].astype(np.int64))
        inputs = torch.full((self.seq_len,), PAD_TOKEN, dtype=torch.int64)
        targets = torch.full((self.seq_len,), IGNORE_INDEX, dtype=torch.int64)
        inputs[: length - 1] = window[:-1]
        targets[: length - 1] = window[1:]
        return inputs, targets


def world_and_rank() -> tuple[int, int]:
    """``(processes, this rank)`` of the default process group, ``(1, 0)`` without one."""
    return (dist.get_world_size(), dist.get_rank()) if dist.is_available() and dist.is_initialized() else (1, 0)


class ResumableSampler(DistributedSampler):
    """DistributedSampler (shuffle by seed + epoch, one shard per rank) that can skip the
    batches of an epoch already trained on, so a run resumed mid-epoch sees the same data
    as an uninterrupted one. ``__len__`` stays the full epoch, as Lightning expects.
    """

    def __init__(self, dataset: Dataset, *, shuffle: bool, seed: int, drop_last: bool = False):
        world, rank = world_and_rank()
        super().__init__(dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.skip: tuple[int, int] | None = None  # (epoch, samples of this rank to skip)

    def __iter__(self):
        indices = list(super().__iter__())
        if self.skip is not None and self.skip[0] == self.epoch:
            indices = indices[self.skip[1] :]
        self.skip = None
        return iter(indices)


class EvalSampler(DistributedSampler):
    """Shards evaluation data across ranks without padding, so every sequence counts once
    and DDP metrics equal single-process ones.
    """

    def __init__(self, dataset: Dataset):
        world, rank = world_and_rank()
        super().__init__(dataset, num_replicas=world, rank=rank, shuffle=False)

    def __iter__(self):
        return iter(range(self.rank, len(self.dataset), self.num_replicas))

    def __len__(self) -> int:
        return len(range(self.rank, len(self.dataset), self.num_replicas))


class PythonSourceData(L.LightningDataModule):
    """Byte sequences from Python sources.

    Args:
        corpus_dir: folder searched recursively for ``.py`` files; default: the stdlib of
            the running interpreter.
        seq_len: tokens per training sequence (targets are shifted by one).
        batch_size: sequences per batch (per process under DDP).
        val_fraction, test_fraction: share of files (by path hash) in val and test.
        pad_short_docs: keep documents (and document tails) shorter than ``seq_len + 1``,
            padded with ignored targets; otherwise they are dropped.
        max_files, max_bytes: slice the corpus for quick runs (bounds the train split;
            val/test get a proportional share, at least one file).
        cache_dir: where tokenized splits are cached; default ``~/.cache/flexmoba``.
        num_workers: DataLoader workers.
        seed: shuffling seed.
    """

    def __init__(
        self,
        corpus_dir: str | None = None,
        seq_len: int = 1024,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        pad_short_docs: bool = False,
        max_files: int | None = None,
        max_bytes: int | None = None,
        cache_dir: str | None = None,
        num_workers: int = 0,
        seed: int = 0,
    ):
        super().__init__()
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name, value in (("max_files", max_files), ("max_bytes", max_bytes)):
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if not (0 < val_fraction < 1 and 0 <= test_fraction < 1 and val_fraction + test_fraction < 1):
            raise ValueError(
                f"val_fraction ({val_fraction}) must be in (0, 1), test_fraction ({test_fraction}) in [0, 1), "
                "and their sum below 1"
            )
        self.save_hyperparameters()
        self.corpus_dir = corpus_dir or default_corpus_dir()
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.pad_short_docs = pad_short_docs
        self.max_files = max_files
        self.max_bytes = max_bytes
        self.cache_dir = cache_dir or default_cache_dir()
        self.num_workers = num_workers
        self.seed = seed
        self.fingerprint: str | None = None
        self.datasets: dict[str, ByteSequences] = {}
        self._resume: dict | None = None
        self._train_sampler: ResumableSampler | None = None

    # -- corpus -------------------------------------------------------------------------

    def _selected_files(self) -> dict[str, list[tuple[str, int]]]:
        if not os.path.isdir(self.corpus_dir):
            raise ValueError(f"corpus_dir={self.corpus_dir!r} is not a directory")
        files = list_python_files(self.corpus_dir)
        if not files or not any(size for _, size in files):
            raise ValueError(f"corpus_dir={self.corpus_dir!r} holds no non-empty .py files")
        min_doc_bytes = 2 if self.pad_short_docs else self.seq_len + 1
        selected = select_files(
            files,
            val_fraction=self.val_fraction,
            test_fraction=self.test_fraction,
            min_doc_bytes=min_doc_bytes,
            max_files=self.max_files,
            max_bytes=self.max_bytes,
        )
        for split in ("train", "val"):
            if not selected[split]:
                raise ValueError(
                    f"the {split} split of corpus_dir={self.corpus_dir!r} is empty: no .py file of at least "
                    f"{min_doc_bytes} bytes (seq_len={self.seq_len} + 1) hashes into it; lower seq_len, "
                    "set pad_short_docs=True, or change val_fraction"
                )
        return selected

    def _cache_path(self, fingerprint: str) -> Path:
        return Path(self.cache_dir) / f"corpus-{fingerprint}.npz"

    def prepare_data(self) -> None:
        """Tokenize the corpus into the cache (rank 0 only under DDP)."""
        self._load_or_build(write=True)

    def _load_or_build(self, write: bool) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        selected = self._selected_files()
        fingerprint = corpus_fingerprint(selected, val_fraction=self.val_fraction, test_fraction=self.test_fraction)
        self.fingerprint = fingerprint
        path = self._cache_path(fingerprint)
        if path.exists():
            with np.load(path) as cached:
                return {s: (cached[f"{s}_tokens"], cached[f"{s}_offsets"]) for s in SPLITS}
        splits = {s: read_documents(self.corpus_dir, selected[s]) for s in SPLITS}
        if write:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npz")
            arrays = {}
            for split, (tokens, offsets) in splits.items():
                arrays[f"{split}_tokens"], arrays[f"{split}_offsets"] = tokens, offsets
            np.savez(tmp, **arrays)
            os.replace(tmp, path)  # atomic: a concurrent reader never sees half a file
            manifest = {"fingerprint": fingerprint, "corpus_dir": self.corpus_dir, "python": sys.version,
                        "files": {s: len(selected[s]) for s in SPLITS},
                        "tokens": {s: int(len(splits[s][0])) for s in SPLITS}}
            path.with_suffix(".json").write_text(json.dumps(manifest, indent=2))
        return splits

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        splits = self._load_or_build(write=False)
        for split, (tokens, offsets) in splits.items():
            self.datasets[split] = ByteSequences(tokens, offsets, self.seq_len, self.pad_short_docs)
        for split in ("train", "val"):
            if len(self.datasets[split]) == 0:
                raise ValueError(f"the {split} split has no sequences of seq_len={self.seq_len}")

    # -- loaders ------------------------------------------------------------------------

    def train_dataloader(self) -> DataLoader:
        sampler = ResumableSampler(self.datasets["train"], shuffle=True, seed=self.seed, drop_last=True)
        if self._resume is not None:
            sampler.skip = (self._resume["epoch"], self._resume["batches"] * self.batch_size)
            self._resume = None
        self._train_sampler = sampler
        return DataLoader(self.datasets["train"], batch_size=self.batch_size, sampler=sampler, drop_last=True,
                          num_workers=self.num_workers)

    def _eval_loader(self, split: str) -> DataLoader:
        dataset = self.datasets[split] if len(self.datasets[split]) else self.datasets["val"]
        return DataLoader(dataset, batch_size=self.batch_size, sampler=EvalSampler(dataset),
                          num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("val")

    def test_dataloader(self) -> DataLoader:
        """The test split, or val when ``test_fraction`` is 0 or the slice left it empty."""
        return self._eval_loader("test")

    def predict_dataloader(self) -> DataLoader:
        return self._eval_loader("val")

    # -- resuming mid-epoch -------------------------------------------------------------

    def state_dict(self) -> dict:
        state = {"fingerprint": self.fingerprint}
        trainer = getattr(self, "trainer", None)
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            # Batches this epoch that the training loop has taken (prefetched ones excluded).
            taken = trainer.fit_loop.epoch_loop.batch_progress.current.ready
            state["train_position"] = {"epoch": trainer.current_epoch, "batches": int(taken)}
        return state

    def load_state_dict(self, state: dict) -> None:
        fingerprint = state.get("fingerprint")
        if fingerprint and self.fingerprint and fingerprint != self.fingerprint:
            raise ValueError(
                f"checkpoint was trained on corpus fingerprint {fingerprint}, but the configured data has "
                f"{self.fingerprint}; use the same corpus_dir/max_files/max_bytes/seq_len"
            )
        self._resume = state.get("train_position")
