"""A byte corpus where far context pays: real files in which spans are exact copies of spans far earlier.

Every training, validation and test sequence of :class:`ByteFilesData` (``seq_len + 1`` bytes of
one document) gets spans of ``repeat_span_bytes`` bytes overwritten by copies of spans that
start a distance of at least ``min(repeat_distances)`` bytes earlier in the same sequence, until
``repeat_share`` of its bytes are copies. Each copy draws one distance bin (``[d_i, d_{i+1})``,
the last up to the sequence's end) and a distance in it uniformly. Sources never overlap a copy,
so a copy repeats text that occurs there for the first time (as far as the files themselves do
not repeat). Copies and sources lie inside byte positions ``[1, seq_len]`` of their sequence, so
every one of their bytes is a target.

The copies are written once into the memory-mapped cache, beside a sidecar ``.repeats.npy``
(``int64 [n_repeats, 3]``: start, length and source start, as offsets into the token file), all
renamed into place before the manifest; :meth:`LongRangeData.repeats_of` gives one sequence's
copies relative to its first byte, for :func:`lit.training.metrics.repeat_span_losses`. The
placement is seeded by ``repeat_seed`` and each sequence's place in the file, so it does not
depend on the training seed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lit.training.data import ByteFilesData, ByteSequences, CorpusError, TokenCache, sequence_starts

REPEATS_SUFFIX = ".repeats.npy"
DEFAULT_SPAN_BYTES = (128, 512)
DEFAULT_SHARE = 0.3
REPEAT_CONTENTS = ("text", "random")  # what a source span holds: the file's own bytes, or random printable ones
PRINTABLE = np.arange(32, 127, dtype=np.uint8)  # the 95 printable ASCII bytes
DEFAULT_DISTANCE_DIVISORS = (8, 4, 2)  # bins from seq_len/8, /4, /2: 4K, 8K and 16K at 32K
MAX_FAILED_PLACEMENTS = 400  # per sequence: tries whose copy or source would overlap a copy


def default_distances(seq_len: int) -> list[int]:
    return [seq_len // divisor for divisor in DEFAULT_DISTANCE_DIVISORS]


@dataclass(frozen=True)
class RepeatPlan:
    """How copies are placed in a sequence: span lengths ``[min, max]``, byte share, distance bins'
    starts, and what the sources hold (``"text"``: the file's bytes; ``"random"``: random printable bytes)."""

    span_bytes: tuple[int, int]
    share: float
    distances: tuple[int, ...]
    content: str = "text"

    def distance_range(self, bin_index: int, length: int, n: int) -> tuple[int, int]:
        """``[low, high)`` distances of a ``length``-byte copy in bin ``bin_index`` of an ``n``-byte sequence."""
        largest = n - 2 - length  # copy ending at byte n - 2, source starting at byte 1
        low = self.distances[bin_index]
        high = self.distances[bin_index + 1] if bin_index + 1 < len(self.distances) else largest + 1
        return low, min(high, largest + 1)


def check_plan(plan: RepeatPlan, seq_len: int) -> None:
    """CorpusError naming the option when copies of this plan cannot fit in a ``seq_len`` sequence."""
    shortest, longest = plan.span_bytes
    if not 0 < shortest <= longest:
        raise CorpusError("repeat_span_bytes", f"repeat_span_bytes must be [min, max] with 0 < min <= max, "
                                               f"got {list(plan.span_bytes)}")
    if not 0 < plan.share <= 0.5:
        raise CorpusError("repeat_share", f"repeat_share must be in (0, 0.5] (sources and copies never overlap), "
                                          f"got {plan.share}")
    if not plan.distances or list(plan.distances) != sorted(set(plan.distances)) or plan.distances[0] <= 0:
        raise CorpusError("repeat_distances", "repeat_distances must be ascending positive distances in bytes, "
                                              f"got {list(plan.distances)}")
    if plan.content not in REPEAT_CONTENTS:
        raise CorpusError("repeat_content", f"repeat_content must be one of {list(REPEAT_CONTENTS)}, "
                                            f"got {plan.content!r}")
    if plan.distances[-1] + longest + 1 > seq_len:
        raise CorpusError("repeat_distances", f"a {longest}-byte copy at distance {plan.distances[-1]} does not fit "
                                              f"in seq_len={seq_len}: lower repeat_distances or repeat_span_bytes")


def place_repeats(n: int, plan: RepeatPlan, rng: np.random.Generator) -> np.ndarray:
    """``int64 [r, 3]`` (start, length, source start) of copies in an ``n``-byte sequence, sorted by start.

    Copies never overlap each other or any source; sources may overlap each other.
    """
    copied = np.zeros(n, dtype=bool)
    sourced = np.zeros(n, dtype=bool)
    repeats, covered, failures = [], 0, 0
    while covered < plan.share * n and failures < MAX_FAILED_PLACEMENTS:
        length = int(rng.integers(plan.span_bytes[0], plan.span_bytes[1] + 1))
        low, high = plan.distance_range(int(rng.integers(len(plan.distances))), length, n)
        if low >= high:
            failures += 1
            continue
        distance = int(rng.integers(low, high))
        start = int(rng.integers(1 + distance, n - length))  # the copy ends by byte n - 2
        source = start - distance
        if copied[start : start + length].any() or sourced[start : start + length].any() \
                or copied[source : source + length].any():
            failures += 1
            continue
        copied[start : start + length] = True
        sourced[source : source + length] = True
        repeats.append((start, length, source))
        covered += length
    return np.asarray(sorted(repeats), dtype=np.int64).reshape(-1, 3)


def write_repeats(tokens: np.ndarray, sequences: tuple[np.ndarray, np.ndarray], plan: RepeatPlan,
                  seed: int) -> np.ndarray:
    """Overwrite spans of every sequence ``(starts, lengths)`` of ``tokens`` (writable) with copies;
    return their ``int64 [R, 3]`` (start, length, source start) as offsets into ``tokens``.

    With ``plan.content == "random"`` every source span is first filled with random printable
    bytes, all of them before any copy is written (sources may overlap; copies never overlap one).
    """
    found = []
    for first, n in zip(*sequences, strict=True):
        rng = np.random.default_rng([seed, int(first)])
        relative = place_repeats(int(n), plan, rng)
        if plan.content == "random":
            for _, length, source in relative:
                tokens[first + source : first + source + length] = rng.choice(PRINTABLE, size=length)
        for start, length, source in relative:
            tokens[first + start : first + start + length] = tokens[first + source : first + source + length]
        found.append(relative + np.array([first, 0, first]))
    return np.concatenate(found) if found else np.zeros((0, 3), dtype=np.int64)


class RepeatCache(TokenCache):
    """The byte cache with copies written into its sequences and their sidecar, all before the manifest."""

    extra_suffixes = (REPEATS_SUFFIX,)

    def __init__(self, cache_dir: str, stem: str, plan: RepeatPlan, seed: int, seq_len: int, pad_short_docs: bool):
        super().__init__(cache_dir, stem)
        self.plan, self.seed, self.seq_len, self.pad_short_docs = plan, seed, seq_len, pad_short_docs

    def write_extras(self, tmp: dict[str, Path], manifest: dict) -> dict:
        tokens = np.memmap(tmp[".bin"], dtype=self.dtype, mode="r+")
        sequences = sequence_starts(np.load(tmp[".npy"]), self.seq_len, self.pad_short_docs)
        repeats = write_repeats(tokens, sequences, self.plan, self.seed)
        tokens.flush()
        del tokens
        np.save(tmp[REPEATS_SUFFIX], repeats)
        copied = int(repeats[:, 1].sum())
        return {**manifest, "repeats": {"count": len(repeats), "bytes": copied,
                                        "share": copied / max(1, int(sequences[1].sum()))}}

    def read_repeats(self) -> np.ndarray:
        return np.load(self.path(REPEATS_SUFFIX))


class LongRangeData(ByteFilesData):
    """:class:`ByteFilesData` whose sequences hold exact copies of spans far earlier in them.

    Args:
        repeat_span_bytes: ``[min, max]`` bytes of a copied span (drawn uniformly).
        repeat_share: share of each sequence's bytes that are copies (at most 0.5).
        repeat_distances: ascending starts of the distance bins, in bytes; a copy lies at least
            the first one after its source. Default: ``seq_len`` / 8, / 4, / 2 (4K, 8K, 16K at 32K).
        repeat_seed: seeds where copies go (the same corpus for every training seed).
        repeat_content: ``"text"`` (a source is the file's own text) or ``"random"`` (a source is
            overwritten with random printable bytes: its first occurrence cannot be predicted, its
            copy only from the source, far back).
        **kwargs: the arguments of :class:`ByteFilesData`.
    """

    def __init__(self, repeat_span_bytes: Sequence[int] = DEFAULT_SPAN_BYTES, repeat_share: float = DEFAULT_SHARE,
                 repeat_distances: list[int] | None = None, repeat_seed: int = 0, repeat_content: str = "text",
                 **kwargs):
        super().__init__(**kwargs)
        distances = default_distances(self.seq_len) if repeat_distances is None else repeat_distances
        self.plan = RepeatPlan(tuple(repeat_span_bytes), repeat_share, tuple(distances), repeat_content)
        self.repeat_seed = repeat_seed
        self.repeats: np.ndarray | None = None

    def _selected_files(self) -> dict[str, list[tuple[str, int]]]:
        check_plan(self.plan, self.seq_len)
        return super()._selected_files()

    def _fingerprint(self, selected: dict[str, list[tuple[str, int]]]) -> str:
        options = {"corpus": super()._fingerprint(selected), "seq_len": self.seq_len, "seed": self.repeat_seed,
                   "pad_short_docs": self.pad_short_docs, "span_bytes": list(self.plan.span_bytes),
                   "share": self.plan.share, "distances": list(self.plan.distances)}
        if self.plan.content != "text":  # the text corpus keeps the cache key it always had
            options["content"] = self.plan.content
        return hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:16]

    def _token_cache(self, key: str) -> RepeatCache:
        return RepeatCache(self.cache_dir, f"repeats-{key}", self.plan, self.repeat_seed, self.seq_len,
                           self.pad_short_docs)

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        if self.repeats is None:
            cache, _ = self._cache()
            self.repeats = cache.read_repeats()

    def repeats_of(self, split: str, index: int) -> np.ndarray:
        """``int64 [r, 3]`` (start, length, source start) of sequence ``index`` of ``split``, relative
        to its first byte: byte ``p`` of the sequence is input ``p`` and target ``p - 1``."""
        dataset: ByteSequences = self.datasets[split]
        first, n = int(dataset.starts[index]), int(dataset.lengths[index])
        lo, hi = np.searchsorted(self.repeats[:, 0], [first, first + n])
        return self.repeats[lo:hi] - np.array([first, 0, first])
