"""Hypothesis strategies for MoBA problems: shapes, chunking, documents, inputs.

Most drawn problems put the gate to a real choice: some query has more past chunks in its
document than it may select (``2 <= top_k < chunks in its document``). The rest cover the
edges (``top_k = 1``, ``top_k >= n_chunks``, chunks longer than the sequence). Documents
are drawn as *runs* of ids, the library's definition: ids are reused, also non-adjacently
(``[7, 7, 3, 3, 7]`` is three documents), and a document may be one token long.
:func:`describe` says which of these a problem exercises; ``test_selection`` checks the
mix, so a change here cannot quietly stop choosing.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from hypothesis import example, settings
from hypothesis import strategies as st

from flexmoba import moba_attention, moba_reference

import oracle


@dataclass(frozen=True)
class Problem:
    """One MoBA problem. Frozen: ``@example`` problems are shared by every test that uses
    them, so a test changes one with :meth:`but` (a copy), never in place."""

    q: torch.Tensor  # [B, H, S, D]
    k: torch.Tensor  # [B, H_kv, S, D]
    v: torch.Tensor  # [B, H_kv, S, D]
    chunk_size: int
    top_k: int
    granularity: str | int
    document_ids: torch.Tensor | None  # [B, S]
    scale: float | None = field(default=None)  # softmax scale; None: D ** -0.5

    @property
    def kwargs(self) -> dict:
        """The gate's arguments (what selection, masks and block masks take)."""
        return dict(chunk_size=self.chunk_size, top_k=self.top_k, granularity=self.granularity,
                    document_ids=self.document_ids)

    @property
    def attention_kwargs(self) -> dict:
        """:attr:`kwargs` plus the softmax ``scale`` (what attention backends and the oracle take)."""
        return dict(self.kwargs, scale=self.scale)

    def but(self, **changes) -> Problem:
        """A copy with ``changes`` applied."""
        return replace(self, **changes)

    def to(self, dtype: torch.dtype) -> Problem:
        return self.but(q=self.q.to(dtype), k=self.k.to(dtype), v=self.v.to(dtype))

    def __repr__(self) -> str:
        docs = None if self.document_ids is None else self.document_ids.tolist()
        return (f"Problem(q={tuple(self.q.shape)}, k={tuple(self.k.shape)}, chunk_size={self.chunk_size}, "
                f"top_k={self.top_k}, granularity={self.granularity!r}, scale={self.scale}, document_ids={docs})")


def random_inputs(seed: int, B: int, H: int, H_kv: int, S: int, D: int):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, S, D, generator=gen), torch.randn(B, H_kv, S, D, generator=gen),
            torch.randn(B, H_kv, S, D, generator=gen))


def make_problem(B, H, H_kv, S, D, chunk_size, top_k, granularity="token", document_ids=None, scale=None, seed=0):
    """A concrete problem (for ``@example``): random inputs from ``seed``; ids as nested lists."""
    if document_ids is not None:
        document_ids = torch.tensor(document_ids, dtype=torch.long)
        assert document_ids.shape == (B, S), document_ids.shape
    q, k, v = random_inputs(seed, B, H, H_kv, S, D)
    return Problem(q, k, v, chunk_size, top_k, granularity, document_ids, scale)


def runs_to_ids(runs: list[tuple[int, int]]) -> list[int]:
    """``[(id, length), ...]`` -> the flat id list."""
    return [doc for doc, length in runs for _ in range(length)]


# -- what a problem exercises -------------------------------------------------------------


@dataclass(frozen=True)
class Features:
    chooses: bool  # some query has more past chunks in its document than top_k - 1
    gqa: bool  # query heads share KV heads, with H_kv >= 2 (so h // group != h % H_kv)
    tiles: bool  # int granularity > 1
    reused_ids: bool  # some id labels two non-adjacent documents
    one_token_document: bool
    n_documents: int  # most documents in one row


def describe(problem: Problem) -> Features:
    B, H, S, _ = problem.q.shape
    H_kv = problem.k.shape[1]
    chooses, reused, one_token, most = False, False, False, 1
    for b in range(B):
        ids = None if problem.document_ids is None else problem.document_ids[b]
        runs = oracle.documents(ids, S)
        most = max(most, len(runs))
        longest = max(end - start for start, end in runs)
        chooses |= problem.top_k >= 2 and -(-longest // problem.chunk_size) > problem.top_k
        one_token |= ids is not None and any(end - start == 1 for start, end in runs)
        if ids is not None:
            labels = [int(ids[start]) for start, _ in runs]
            reused |= len(set(labels)) < len(labels)
    return Features(chooses, H_kv >= 2 and H > H_kv, problem.granularity not in ("token", 1), reused, one_token,
                    most)


# -- strategies ---------------------------------------------------------------------------


@st.composite
def document_runs(draw, seq_len: int, main: int = 1):
    """``[(id, length), ...]`` covering ``seq_len``, one run at least ``main`` long.

    Ids come from a pool of three, never equal to the previous run's id (equal neighbours
    would merge into one run), so labels are reused across non-adjacent documents. Short
    runs, length 1 included, surround the main run.
    """
    main = draw(st.integers(max(1, main), seq_len))
    rest = seq_len - main
    before = draw(st.integers(0, rest))
    lengths = []
    for budget in (before, rest - before):
        side = []
        while budget:
            n = draw(st.one_of(st.just(1), st.integers(1, budget)))
            side.append(n)
            budget -= n
        lengths.append(side)
    lengths = lengths[0] + [main] + lengths[1]
    pool = draw(st.sampled_from([(0, 1, 2), (7, 3, 5), (-1, 4, 9)]))
    ids, previous = [], None
    for _ in lengths:
        label = draw(st.sampled_from([p for p in pool if p != previous]))
        ids.append(label)
        previous = label
    return list(zip(ids, lengths, strict=True))


@st.composite
def document_ids(draw, batch: int, seq_len: int, main: int = 1):
    """None (a quarter of the time), or ``[B, S]`` ids as runs (each row its own split).

    ``main``: the first row always holds a document at least that long (so the gate can
    still choose inside it).
    """
    if draw(st.integers(0, 3)) == 0:
        return None
    rows = [runs_to_ids(draw(document_runs(seq_len, main if b == 0 else 1))) for b in range(batch)]
    return torch.tensor(rows, dtype=torch.long)


def divisors(n: int) -> list[int]:
    return [g for g in range(1, n + 1) if n % g == 0]


@st.composite
def granularities(draw, chunk_size: int):
    """``"token"`` half the time, else a tile size dividing ``chunk_size`` (proper divisors > 1 first)."""
    if draw(st.booleans()):
        return "token"
    proper = [g for g in divisors(chunk_size) if 1 < g < chunk_size]
    return draw(st.sampled_from(proper or divisors(chunk_size)))


@st.composite
def chunking(draw, seq_len: int):
    """(chunk_size, top_k, granularity) over the edges: chunks from 1 past S, top_k from 1 past n_chunks."""
    chunk_size = draw(st.one_of(st.just(1), st.sampled_from([3, 5, 7, 8, 12, 16]), st.integers(1, seq_len + 8)))
    n_chunks = -(-seq_len // chunk_size)
    top_k = draw(st.integers(1, n_chunks + 2))
    divisors_ = divisors(chunk_size)
    granularity = draw(st.one_of(st.just("token"), st.sampled_from(divisors_)))
    return chunk_size, top_k, granularity


# Softmax scales other than D ** -0.5 (HF models may set their own). Up to 1: beyond, with
# D = 8, fp32 gradients of two exact implementations drift apart by more than 2e-5.
scales = st.sampled_from([0.05, 0.3, 0.7, 1.0]) | st.floats(0.01, 1.0)


@st.composite
def problems(draw, max_seq_len: int = 64, token_only: bool = False, choose: bool | None = None,
             tiles: bool = False, scaled: bool = False):
    """A MoBA problem; three in four put the gate to a choice (``choose=True`` forces it).

    ``tiles=True``: a choosing problem at tile granularity (tiles of 2 tokens or more).
    The softmax scale is the default half the time; ``scaled=True`` always draws one.

    Choosing problems have ``S >= 3 * chunk_size``, ``2 <= top_k <= n_chunks - 1`` and,
    with documents, one document in the first row long enough that its last chunk's
    queries must pick among more past chunks than they may take.
    """
    B = draw(st.integers(1, 2))
    H_kv = draw(st.integers(1, 2))
    H = H_kv * draw(st.sampled_from([1, 2, 3]))
    D = draw(st.sampled_from([4, 8]))
    if choose is None:
        choose = tiles or draw(st.integers(0, 3)) > 0
    if choose:
        sizes = [2, 3, 4, 6, 8] if tiles else [1, 2, 3, 4, 6, 8]
        chunk_size = draw(st.sampled_from([c for c in sizes if 3 * c <= max_seq_len]))
        S = draw(st.integers(3 * chunk_size, max_seq_len))
        n_chunks = -(-S // chunk_size)
        top_k = draw(st.integers(2, n_chunks - 1))
        if tiles:
            granularity = draw(st.sampled_from(divisors(chunk_size)[1:]))
        else:
            granularity = draw(granularities(chunk_size))
        ids = draw(document_ids(B, S, main=top_k * chunk_size + 1))
    else:
        S = draw(st.integers(1, max_seq_len))
        chunk_size, top_k, granularity = draw(chunking(S))
        ids = draw(document_ids(B, S))
    if token_only:
        granularity = "token"
    scale = draw(scales if scaled else st.none() | scales)
    q, k, v = random_inputs(draw(st.integers(0, 2**31 - 1)), B, H, H_kv, S, D)
    return Problem(q, k, v, chunk_size, top_k, granularity, ids, scale)


def more_examples(factor: int = 4) -> settings:
    """Settings with ``factor`` times the active profile's examples (for cheap tests)."""
    return settings(max_examples=settings.default.max_examples * factor)


# -- explicit examples: one of each kind the strategies are meant to cover -----------------

EXAMPLES = {
    # GQA (2 KV heads, 2 query heads each) where every query of the last chunks chooses.
    "gqa_choice": make_problem(1, 4, 2, 48, 8, chunk_size=6, top_k=3, seed=11),
    # Tiles of 2 inside chunks of 4, a real choice among 11 past chunks.
    "tiles_choice": make_problem(2, 2, 1, 48, 4, chunk_size=4, top_k=3, granularity=2, seed=12),
    # Ids reused non-adjacently: 7 labels the first and third documents, 3 the second and fourth.
    "reused_ids": make_problem(1, 2, 1, 40, 8, chunk_size=4, top_k=2, seed=13, document_ids=[
        runs_to_ids([(7, 12), (3, 6), (7, 14), (3, 8)])]),
    # One-token documents, at the start, in the middle (between equal labels) and at the end.
    "one_token_documents": make_problem(2, 2, 2, 36, 4, chunk_size=3, top_k=2, seed=14, document_ids=[
        runs_to_ids([(0, 1), (1, 16), (0, 1), (1, 17), (2, 1)]),
        runs_to_ids([(5, 20), (4, 1), (5, 14), (4, 1)])]),
    # A custom softmax scale, with GQA, documents and a real choice.
    "custom_scale": make_problem(1, 4, 2, 40, 8, chunk_size=4, top_k=3, scale=0.3, seed=16, document_ids=[
        runs_to_ids([(1, 3), (2, 30), (1, 7)])]),
    # Everything at once: GQA, tiles, reused ids, a one-token document, a scale, a real choice.
    "all_at_once": make_problem(2, 6, 2, 60, 8, chunk_size=6, top_k=3, granularity=3, scale=0.7, seed=15,
                                document_ids=[runs_to_ids([(2, 1), (9, 40), (2, 7), (9, 12)]),
                                              runs_to_ids([(4, 30), (1, 1), (4, 29)])]),
}


def with_examples(*names: str):
    """Decorate a ``@given(problem)`` test with the named :data:`EXAMPLES` (all by default)."""

    def decorate(test):
        for name in reversed(names or tuple(EXAMPLES)):
            test = example(EXAMPLES[name])(test)
        return test

    return decorate


# The compiled flex kernel is specialised per shape (and per number of chunks, the shape
# of a tensor its mask_mod reads), so its tests draw from this small fixed set.
FLEX_SHAPES = [(1, 2, 1, 64, 8), (2, 4, 2, 48, 8)]  # (B, H, H_kv, S, D)
FLEX_CHUNK_SIZES = [8, 16]


@st.composite
def flex_problems(draw):
    B, H, H_kv, S, D = draw(st.sampled_from(FLEX_SHAPES))
    chunk_size = draw(st.sampled_from(FLEX_CHUNK_SIZES))
    top_k = draw(st.integers(1, -(-S // chunk_size) + 1))
    granularity = draw(st.sampled_from(["token", "token", 4, chunk_size]))
    q, k, v = random_inputs(draw(st.integers(0, 2**31 - 1)), B, H, H_kv, S, D)
    # Two scales only: the compiled kernel specialises on the scale, so each new one recompiles.
    scale = draw(st.sampled_from([None, None, 0.3]))
    return Problem(q, k, v, chunk_size, top_k, granularity, draw(document_ids(B, S)), scale)


def run_backend(backend, q, k, v, **kwargs):
    """MoBA attention by one named backend (``"reference"``: :func:`moba_reference`)."""
    if backend == "reference":
        return moba_reference(q, k, v, **kwargs)
    return moba_attention(q, k, v, backend=backend, **kwargs)


def seeded_randn(like):
    """Normal noise shaped like ``like``, the same on every call (a retried example sees the same)."""
    return torch.randn(like.shape, generator=torch.Generator().manual_seed(like.numel()), dtype=like.dtype)
