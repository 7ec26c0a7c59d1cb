"""Byte-level corpus of files under a root (default: the ``.py`` files of this interpreter's stdlib).

- Documents are the files under ``root`` whose path matches one of ``patterns`` (globs such
  as ``*.txt``, matched against the end of the relative path, so at any depth); hidden
  folders, ``site-packages`` and ``__pycache__`` are skipped.
- Tokens are raw bytes (vocabulary 256).
- A document is one file, or with ``documents="packages"`` one package folder: every
  matching file directly in that folder, concatenated in sorted path order (files at the
  root stay documents of their own). ``min_document_bytes`` keeps long documents only.
- Train/val/test split by a hash of each document's relative path (a file's, or a package
  folder's): stable across machines and across ``max_files``/``max_bytes`` slices.
- Training sequences are ``seq_len + 1`` tokens cut from one document (never across a
  document boundary), so "position t" really means "t tokens into a file"; a long document
  stays whole and gives many sequences.
- The tokenized corpus is cached under ``cache_dir`` as a raw ``uint8`` file (``.bin``,
  memory-mapped by every process and DataLoader worker, never loaded whole), document
  offsets (``.npy``) and a manifest (``.json``, written last: a cache without it is not
  there yet). The first process to need it writes it, atomically.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import sysconfig
from collections.abc import Iterator, Sequence
from itertools import islice
from pathlib import Path, PurePosixPath

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lit.training.context_parallel import MeshRanks, SequenceSlice, mesh_ranks
from lit.training.metrics import IGNORE_INDEX

PAD_TOKEN = 0  # input filler after a short document ends; its targets are IGNORE_INDEX
SPLITS = ("train", "val", "test")
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
DEFAULT_PATTERNS = ("*.py",)
DOCUMENT_KINDS = ("files", "packages")


def default_root() -> str:
    """The running interpreter's standard library."""
    return sysconfig.get_paths()["stdlib"]


def default_cache_dir() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "flexmoba")


def walk_files(root: str) -> Iterator[Path]:
    """Every regular file under ``root``, skipping hidden folders and Python's package folders."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        for name in filenames:
            path = Path(dirpath) / name
            if path.is_file():
                yield path


def matches(relative_path: str, patterns: Sequence[str]) -> bool:
    return any(PurePosixPath(relative_path).match(pattern) for pattern in patterns)


def list_files(root: str, patterns: Sequence[str] = DEFAULT_PATTERNS) -> list[tuple[str, int]]:
    """Sorted ``(relative path, size in bytes)`` of the files under ``root`` matching ``patterns``."""
    files = []
    for path in walk_files(root):
        rel = path.relative_to(root).as_posix()
        if matches(rel, patterns):
            files.append((rel, path.stat().st_size))
    return sorted(files)


def package_of(relative_path: str) -> str:
    """The package folder of a file (``"email/mime/"``), or the file itself at the root."""
    folder = PurePosixPath(relative_path).parent.as_posix()
    return relative_path if folder == "." else folder + "/"


def group_packages(files: list[tuple[str, int]]) -> tuple[list[tuple[str, int]], dict[str, list[str]]]:
    """Package documents: sorted ``(package, total bytes)`` and ``package -> its files in sorted order``."""
    members: dict[str, list[str]] = {}
    sizes: dict[str, int] = {}
    for rel, size in sorted(files):
        package = package_of(rel)
        members.setdefault(package, []).append(rel)
        sizes[package] = sizes.get(package, 0) + size
    return sorted(sizes.items()), members


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


def corpus_fingerprint(selected: dict[str, list[tuple[str, int]]], *, python: str | None = None, **options) -> str:
    """Hash of the selected files (paths and sizes), the slicing options and, for Python sources,
    the Python version. Checkpoints store it, so a resumed run checks its data is the same."""
    payload = {
        "python": python,
        "options": options,
        "files": {split: [[rel, size] for rel, size in files] for split, files in selected.items()},
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def member_files(document: str, members: dict[str, list[str]] | None) -> list[str]:
    """The files of a document, in the order they are concatenated (a file is its own document)."""
    return [document] if members is None else members[document]


def source_key(root: str, selected: dict[str, list[tuple[str, int]]],
               members: dict[str, list[str]] | None = None) -> str:
    """Hash of where the files are and when they last changed: the cache never serves one
    folder's bytes for another folder with the same names and sizes, or for edited files."""
    resolved = Path(root).resolve()
    stamps = [(rel, (resolved / rel).stat().st_mtime_ns) for split in SPLITS for doc, _ in selected[split]
              for rel in member_files(doc, members)]
    payload = {"root": str(resolved), "mtimes": stamps}
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:8]


def is_text(data: bytes) -> bool:
    """Whether ``data`` is UTF-8 text (a corpus of sources should hold nothing else)."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def read_member(root: str, rel: str, not_text: list[str] | None) -> bytes:
    """The bytes of file ``rel`` under ``root``, its name added to ``not_text`` if they are not UTF-8 text."""
    data = (Path(root) / rel).read_bytes()
    if not_text is not None and not is_text(data):
        not_text.append(rel)
    return data


def write_token_file(root: str, documents: list[tuple[str, int]], path: Path,
                     members: dict[str, list[str]] | None = None, not_text: list[str] | None = None) -> np.ndarray:
    """Concatenate the documents' bytes into ``path``, streaming; return document offsets ``[n_docs + 1]``
    (the files that are not UTF-8 text named in ``not_text``)."""
    offsets = [0]
    with open(path, "wb") as out:
        for document, _ in documents:
            n_bytes = 0
            for rel in member_files(document, members):
                data = read_member(root, rel, not_text)
                out.write(data)
                n_bytes += len(data)
            offsets.append(offsets[-1] + n_bytes)
    return np.asarray(offsets, dtype=np.int64)


class CorpusError(ValueError):
    """The files under ``root`` cannot make a corpus; ``option`` is the argument to change."""

    def __init__(self, option: str, message: str):
        super().__init__(message)
        self.option = option


class TokenCache:
    """The corpus tokenized once: ``<stem>.bin`` (uint8 bytes of every document, train then
    val then test), ``<stem>.npy`` (document offsets into it) and ``<stem>.json`` (manifest:
    each split's document range). Written by whichever process gets there first; every file
    is renamed into place, the manifest last, so a reader sees a whole cache or none.
    """

    dtype = np.uint8  # of the token file
    extra_suffixes: tuple[str, ...] = ()  # sidecar files a subclass writes beside the tokens

    def __init__(self, cache_dir: str, stem: str):
        self.base = Path(cache_dir) / stem
        self.not_text: list[str] = []  # files of the corpus that are not UTF-8 text, found while writing

    def path(self, suffix: str) -> Path:
        return self.base.with_name(self.base.name + suffix)

    def suffixes(self) -> tuple[str, ...]:
        return (".bin", ".npy", *self.extra_suffixes, ".json")

    def exists(self) -> bool:
        return all(self.path(s).is_file() for s in self.suffixes())

    def write_tokens(self, root: str, documents: list[tuple[str, int]], tmp: dict[str, Path],
                     members: dict[str, list[str]] | None) -> np.ndarray:
        """Write the documents' tokens to ``tmp[".bin"]``; return document offsets ``[n_docs + 1]``."""
        return write_token_file(root, documents, tmp[".bin"], members, self.not_text)

    def write_extras(self, tmp: dict[str, Path], manifest: dict) -> dict:
        """Write the sidecars of ``extra_suffixes`` to ``tmp`` (the token file is whole); return the manifest."""
        return manifest

    def write(self, root: str, selected: dict[str, list[tuple[str, int]]], manifest: dict,
              members: dict[str, list[str]] | None = None) -> None:
        self.base.parent.mkdir(parents=True, exist_ok=True)
        tmp = {s: self.path(f".{os.getpid()}.tmp{s}") for s in self.suffixes()}
        files = [f for split in SPLITS for f in selected[split]]
        offsets = self.write_tokens(root, files, tmp, members)
        np.save(tmp[".npy"], offsets)
        first_doc = np.cumsum([0] + [len(selected[split]) for split in SPLITS]).tolist()
        manifest = {**manifest, "documents": {s: first_doc[i : i + 2] for i, s in enumerate(SPLITS)},
                    "tokens": {s: int(offsets[first_doc[i + 1]] - offsets[first_doc[i]]) for i, s in enumerate(SPLITS)},
                    "not_text": sorted(self.not_text)}
        manifest = self.write_extras(tmp, manifest)
        tmp[".json"].write_text(json.dumps(manifest, indent=2))
        for suffix in self.suffixes():  # atomic renames, the manifest last
            os.replace(tmp[suffix], self.path(suffix))

    def manifest(self) -> dict:
        return json.loads(self.path(".json").read_text())

    def read(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Each split's ``(tokens, offsets)``: tokens is the memory-mapped file, offsets index into it."""
        documents = self.manifest()["documents"]
        tokens = np.memmap(self.path(".bin"), dtype=self.dtype, mode="r")
        offsets = np.load(self.path(".npy"))
        return {split: (tokens, offsets[first : last + 1]) for split, (first, last) in documents.items()}


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
    """``(inputs, targets)``, each ``[seq_len]`` int64; padded targets are ``IGNORE_INDEX``.

    ``tokens`` may be a memory-mapped file; pickled (to a spawned DataLoader worker) it
    travels as its file name and is mapped again, never copied.
    """

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

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        if isinstance(self.tokens, np.memmap):
            state["tokens"] = MappedFile(self.tokens.filename, self.tokens.dtype.str)
        return state

    def __setstate__(self, state: dict) -> None:
        if isinstance(state["tokens"], MappedFile):
            state["tokens"] = np.memmap(state["tokens"].filename, dtype=state["tokens"].dtype, mode="r")
        self.__dict__.update(state)


class MappedFile:
    """A memory-mapped token file, by name (what a pickled :class:`ByteSequences` carries)."""

    def __init__(self, filename: str, dtype: str = "|u1"):
        self.filename = filename
        self.dtype = dtype


def world_and_rank() -> tuple[int, int]:
    """``(processes, this rank)`` of the default process group, ``(1, 0)`` without one."""
    return (dist.get_world_size(), dist.get_rank()) if dist.is_available() and dist.is_initialized() else (1, 0)


class ResumableSampler(DistributedSampler):
    """DistributedSampler (shuffle by seed + epoch, one shard per rank) that can skip the
    batches of an epoch already trained on, so a run resumed mid-epoch sees the same data
    as an uninterrupted one. ``__len__`` stays the full epoch, as Lightning expects.
    """

    def __init__(self, dataset: Dataset, *, shuffle: bool, seed: int, drop_last: bool = False,
                 ranks: MeshRanks | None = None):
        world, rank = world_and_rank() if ranks is None else (ranks.dp_size, ranks.dp_rank)
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

    def __init__(self, dataset: Dataset, ranks: MeshRanks | None = None):
        world, rank = world_and_rank() if ranks is None else (ranks.dp_size, ranks.dp_rank)
        super().__init__(dataset, num_replicas=world, rank=rank, shuffle=False)

    def __iter__(self):
        return iter(range(self.rank, len(self.dataset), self.num_replicas))

    def __len__(self) -> int:
        return len(range(self.rank, len(self.dataset), self.num_replicas))


class ByteFilesData(L.LightningDataModule):
    """Byte sequences from the files under a folder: your own text, or by default the
    ``.py`` files of the running interpreter's standard library.

    Args:
        root: folder searched recursively; default: the stdlib of the running interpreter.
        patterns: globs a file's relative path must match (one is enough), e.g.
            ``["*.txt", "*.md"]``; matched from the end, so ``*.md`` matches at any depth
            and ``docs/*.md`` the ``.md`` files of any ``docs`` folder. Default ``["*.py"]``.
        seq_len: tokens per training sequence (targets are shifted by one).
        batch_size: sequences per batch (per process under DDP).
        val_fraction, test_fraction: share of documents (by path hash) in val and test.
        documents: ``"files"`` (a document is a file) or ``"packages"`` (a document is a
            package folder's matching files concatenated in sorted order, split by the
            folder's hash): repository-level documents, long enough for long contexts.
        min_document_bytes: drop documents shorter than this (whole long documents only);
            default: only those too short for one sequence (none with ``pad_short_docs``).
        pad_short_docs: keep documents (and document tails) shorter than ``seq_len + 1``,
            padded with ignored targets; otherwise they are dropped.
        max_files, max_bytes: slice the corpus for quick runs (bounds the train split;
            val/test get a proportional share, at least one file).
        cache_dir: where the tokenized corpus is cached; default ``~/.cache/flexmoba``.
        num_workers: DataLoader workers.
        seed: shuffling seed.
    """

    def __init__(
        self,
        root: str | None = None,
        patterns: list[str] | str | None = None,
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
        documents: str = "files",
        min_document_bytes: int | None = None,
    ):
        super().__init__()
        check_arguments(seq_len=seq_len, batch_size=batch_size, max_files=max_files, max_bytes=max_bytes,
                        val_fraction=val_fraction, test_fraction=test_fraction)
        check_documents(documents, min_document_bytes)
        self.save_hyperparameters()
        self.root = os.fspath(root or default_root())
        self.patterns = resolve_patterns(patterns)
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
        self.documents = documents
        self.min_document_bytes = min_document_bytes
        self.members: dict[str, list[str]] | None = None  # package -> files, with documents="packages"
        self.fingerprint: str | None = None
        self.datasets: dict[str, ByteSequences] = {}
        self.selected: dict[str, list[tuple[str, int]]] | None = None  # each split's documents, once listed
        self.usable_documents: int | None = None  # documents long enough, before max_files/max_bytes
        self.not_text: list[str] = []  # files that are not UTF-8 text, once the cache is read
        self._resume: dict | None = None
        self._train_sampler: ResumableSampler | None = None

    # -- corpus -------------------------------------------------------------------------

    def _matching_files(self) -> list[tuple[str, int]]:
        """The files under ``root`` matching ``patterns``; a clear error when there are none."""
        if not os.path.isdir(self.root):
            what = "is not a directory" if os.path.exists(self.root) else "does not exist"
            raise CorpusError("root", f"root={self.root!r} {what}")
        files = list_files(self.root, self.patterns)
        if files:
            return files
        others = [path.relative_to(self.root).as_posix() for path in islice(walk_files(self.root), 3)]
        if not others:
            raise CorpusError("root", f"root={self.root!r} is empty: it holds no files (hidden folders are skipped)")
        raise CorpusError("patterns", f"patterns={self.patterns!r} match no file under root={self.root!r} "
                                      f"(it holds e.g. {', '.join(others)})")

    def check_files(self) -> None:
        """Raise :class:`CorpusError` (naming the argument to change) if ``root``, ``patterns`` and
        ``seq_len`` give no usable train and val files; reads no file, so a command line can call
        it before anything is built."""
        self._selected_files()

    def _documents(self) -> list[tuple[str, int]]:
        """``(name, bytes)`` of every document: the matching files, or their package folders."""
        files = self._matching_files()
        if self.documents == "files":
            return files
        documents, self.members = group_packages(files)
        return documents

    def _min_document_bytes(self) -> int:
        fits_one_sequence = 2 if self.pad_short_docs else self.seq_len + 1
        return max(fits_one_sequence, self.min_document_bytes or 0)

    def _selected_files(self) -> dict[str, list[tuple[str, int]]]:
        files = self._documents()
        min_doc_bytes = self._min_document_bytes()
        n_short = sum(size < min_doc_bytes for _, size in files)
        self.usable_documents = len(files) - n_short
        if n_short == len(files):
            raise CorpusError(
                "seq_len",
                f"all {n_short} files matching patterns={self.patterns!r} under root={self.root!r} are shorter "
                f"than {min_doc_bytes} bytes (seq_len={self.seq_len} + 1), so all were skipped; lower seq_len or "
                "set pad_short_docs=True"
            )
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
                raise CorpusError(
                    "val_fraction" if split == "val" else "root",
                    f"the {split} split of root={self.root!r} is empty: no file of at least {min_doc_bytes} bytes "
                    f"(seq_len={self.seq_len} + 1) hashes into it ({len(files) - n_short} long enough, {n_short} "
                    "shorter ones skipped); add files, lower seq_len, set pad_short_docs=True, or change val_fraction"
                )
        return selected

    def _cache(self) -> tuple[TokenCache, dict[str, list[tuple[str, int]]]]:
        selected = self._selected_files()
        self.fingerprint = self._fingerprint(selected)
        self.selected = selected
        return self._token_cache(f"{self.fingerprint}-{source_key(self.root, selected, self.members)}"), selected

    def _token_cache(self, key: str) -> TokenCache:
        """The cache of this corpus; ``key`` names its fingerprint and where its files are."""
        return TokenCache(self.cache_dir, f"bytes-{key}")

    def _fingerprint(self, selected: dict[str, list[tuple[str, int]]]) -> str:
        """Python sources (the default patterns) as before: with the Python version, which changes the
        stdlib, so checkpoints of earlier runs still resume; other files: with their patterns instead."""
        options = {"val_fraction": self.val_fraction, "test_fraction": self.test_fraction}
        if self.min_document_bytes is not None:
            options["min_document_bytes"] = self.min_document_bytes
        if self.documents != "files":
            options["packages"] = self.members
        if sorted(self.patterns) == sorted(DEFAULT_PATTERNS):
            return corpus_fingerprint(selected, python=sys.version, **options)
        return corpus_fingerprint(selected, patterns=sorted(self.patterns), **options)

    def prepare_data(self) -> None:
        """Tokenize the corpus into the cache (once per node under DDP; later runs reuse it)."""
        self._load_or_build()

    def _load_or_build(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        cache, selected = self._cache()
        if not cache.exists():
            manifest = {"fingerprint": self.fingerprint, "root": str(Path(self.root).resolve()),
                        "patterns": self.patterns, "python": sys.version,
                        "documents_kind": self.documents, "files": {s: len(selected[s]) for s in SPLITS}}
            cache.write(self.root, selected, manifest, self.members)
        self.not_text = cache.manifest().get("not_text", [])  # caches written before the check hold none
        return cache.read()

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        splits = self._load_or_build()
        for split, (tokens, offsets) in splits.items():
            self.datasets[split] = ByteSequences(tokens, offsets, self.seq_len, self.pad_short_docs)
        for split in ("train", "val"):
            if len(self.datasets[split]) == 0:
                raise ValueError(f"the {split} split has no sequences of seq_len={self.seq_len}")

    # -- what it reads -------------------------------------------------------------------

    def split_tokens(self, split: str) -> int:
        """Tokens in ``split`` (bytes here; a tokenized subclass counts its tokens)."""
        return sum(size for _, size in self.selected[split])

    def summary(self, lift: str = "pass {options} to use them all", option: str = "{name} null") -> list[str]:
        """What the run reads, once set up, in one line (two with a cap from the config: what it leaves out
        and how to lift it, ``lift`` naming the ``options`` written as ``option``), without the
        ``flexmoba:`` prefix::

            data: 10 files under /corpus (*.txt), sequences of 128 bytes: train 8 files, 41,234 bytes, 318
            sequences; val 1 file, 482 bytes, 3 sequences; test 1 file, 1,033 bytes, 8 sequences
            data: max_files 8 keeps 8 train files (10 with val and test) of the 265 files long enough; pass
            --data.max_files null to use them all
        """
        selected = self.selected if self.selected is not None else self._selected_files()
        noun = "file" if self.documents == "files" else "package"
        unit = "bytes" if type(self).split_tokens is ByteFilesData.split_tokens else "tokens"
        parts = []
        for split in SPLITS:
            n_bytes = sum(size for _, size in selected[split])
            counts = [counted(len(selected[split]), noun), f"{n_bytes:,} bytes"]
            if unit == "tokens" and self.datasets:
                counts.append(f"{self.split_tokens(split):,} tokens")
            if split in self.datasets:
                counts.append(counted(len(self.datasets[split]), "sequence"))
            parts.append(f"{split} " + ", ".join(counts))
        chosen = sum(len(documents) for documents in selected.values())
        where = f"{counted(chosen, noun)} under {self.root} ({', '.join(self.patterns)})"
        lines = [f"data: {where}, sequences of {self.seq_len} {unit}: " + "; ".join(parts)]
        caps = [(name, value) for name, value in (("max_files", self.max_files), ("max_bytes", self.max_bytes))
                if value is not None]
        usable = self.usable_documents
        if caps and usable is not None and chosen < usable:
            given = " and ".join(f"{name} {value:,}" for name, value in caps)
            options = " ".join(option.format(name=f"--data.{name}") for name, _ in caps)
            kept = f"{counted(len(selected['train']), 'train ' + noun)} ({chosen:,} with val and test)"
            lines.append(f"data: {given} keep{'s' * (len(caps) == 1)} {kept} of the {counted(usable, noun)} "
                         f"long enough; {lift.format(options=options)}")
        if self.not_text:
            lines.append(self.not_text_line(unit))
        return lines

    def not_text_line(self, unit: str) -> str:
        n, names = len(self.not_text), ", ".join(self.not_text[:3]) + ", ..." * (len(self.not_text) > 3)
        is_, it, its = ("is", "it", "its") if n == 1 else ("are", "them", "their")
        read = "trained on as raw bytes" if unit == "bytes" else f"{its} invalid bytes read as U+FFFD"
        return (f"data: {counted(n, 'file')} {is_} not UTF-8 text ({names}), {read}; leave {it} out with "
                f"--data.patterns or by moving {it} away")

    # -- loaders ------------------------------------------------------------------------

    def _mesh(self) -> tuple[MeshRanks, dict]:
        """This process's place in the mesh, and the collate function giving it its slice of each
        sequence (under context parallelism, every rank of a group loads the same sequences)."""
        ranks = mesh_ranks(getattr(self, "trainer", None))
        if ranks.cp_size == 1:
            return ranks, {}
        return ranks, {"collate_fn": SequenceSlice(*ranks.sequence_slice(self.seq_len))}

    def train_dataloader(self) -> DataLoader:
        ranks, collate = self._mesh()
        sampler = ResumableSampler(self.datasets["train"], shuffle=True, seed=self.seed, drop_last=True, ranks=ranks)
        if self._resume is not None:
            sampler.skip = (self._resume["epoch"], self._resume["batches"] * self.batch_size)
            self._resume = None
        self._train_sampler = sampler
        return DataLoader(self.datasets["train"], batch_size=self.batch_size, sampler=sampler, drop_last=True,
                          num_workers=self.num_workers, **collate)

    def _eval_loader(self, split: str) -> DataLoader:
        dataset = self.datasets[split] if len(self.datasets[split]) else self.datasets["val"]
        ranks, collate = self._mesh()
        return DataLoader(dataset, batch_size=self.batch_size, sampler=EvalSampler(dataset, ranks),
                          num_workers=self.num_workers, **collate)

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
            raise CorpusError(
                "root",
                f"checkpoint was trained on corpus fingerprint {fingerprint}, but the configured data has "
                f"{self.fingerprint}; use the same root/patterns/max_files/max_bytes/seq_len"
            )
        self._resume = state.get("train_position")



def counted(count: int, noun: str) -> str:
    """``1 file``, ``3 files``, ``1,024 sequences``."""
    return f"{count:,} {noun}" + ("" if count == 1 else "s")


def check_arguments(*, seq_len, batch_size, max_files, max_bytes, val_fraction, test_fraction) -> None:
    """ValueError naming the first bad argument."""
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


def check_documents(documents: str, min_document_bytes: int | None) -> None:
    """ValueError naming ``documents`` or ``min_document_bytes``."""
    if documents not in DOCUMENT_KINDS:
        raise ValueError(f"documents must be one of {DOCUMENT_KINDS}, got {documents!r}")
    if min_document_bytes is not None and (not isinstance(min_document_bytes, int) or min_document_bytes <= 0):
        raise ValueError(f"min_document_bytes must be a positive int or None, got {min_document_bytes!r}")


def resolve_patterns(patterns: Sequence[str] | str | None) -> list[str]:
    """A list of globs (one string is one glob); ValueError naming ``patterns`` otherwise."""
    if patterns is None:
        return list(DEFAULT_PATTERNS)
    if isinstance(patterns, str):
        patterns = [patterns]
    patterns = list(patterns)
    if not patterns or not all(isinstance(p, str) and p.strip() for p in patterns):
        raise ValueError(f"patterns must be a non-empty list of globs such as ['*.txt', '*.md'], got {patterns!r}")
    return patterns
