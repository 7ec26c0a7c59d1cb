"""Hypothesis strategies for MoBA problems: shapes, chunking, documents, inputs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st


@dataclass
class Problem:
    q: torch.Tensor  # [B, H, S, D]
    k: torch.Tensor  # [B, H_kv, S, D]
    v: torch.Tensor  # [B, H_kv, S, D]
    chunk_size: int
    top_k: int
    granularity: str | int
    document_ids: torch.Tensor | None  # [B, S]

    @property
    def kwargs(self) -> dict:
        return dict(chunk_size=self.chunk_size, top_k=self.top_k, granularity=self.granularity,
                    document_ids=self.document_ids)

    def __repr__(self) -> str:
        docs = None if self.document_ids is None else self.document_ids.tolist()
        return (f"Problem(q={tuple(self.q.shape)}, k={tuple(self.k.shape)}, chunk_size={self.chunk_size}, "
                f"top_k={self.top_k}, granularity={self.granularity!r}, document_ids={docs})")


def random_inputs(seed: int, B: int, H: int, H_kv: int, S: int, D: int):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, S, D, generator=gen), torch.randn(B, H_kv, S, D, generator=gen),
            torch.randn(B, H_kv, S, D, generator=gen))


@st.composite
def document_ids(draw, batch: int, seq_len: int):
    """None, or [B, S] ids with random document boundaries (each row its own split)."""
    if not draw(st.booleans()):
        return None
    rows = []
    for _ in range(batch):
        cuts = draw(st.sets(st.integers(1, max(1, seq_len - 1)), max_size=4)) if seq_len > 1 else set()
        ids, doc = [], draw(st.integers(0, 3))
        for t in range(seq_len):
            if t in cuts:
                doc += draw(st.integers(1, 2))
            ids.append(doc)
        rows.append(ids)
    return torch.tensor(rows, dtype=torch.long)


@st.composite
def chunking(draw, seq_len: int):
    """(chunk_size, top_k, granularity), chunk sizes from 1 past S, top_k from 1 past n_chunks."""
    chunk_size = draw(st.one_of(st.just(1), st.sampled_from([3, 5, 7, 8, 12, 16]), st.integers(1, seq_len + 8)))
    n_chunks = -(-seq_len // chunk_size)
    top_k = draw(st.integers(1, n_chunks + 2))
    divisors = [g for g in range(1, chunk_size + 1) if chunk_size % g == 0]
    granularity = draw(st.one_of(st.just("token"), st.sampled_from(divisors)))
    return chunk_size, top_k, granularity


@st.composite
def problems(draw, max_seq_len: int = 64, token_only: bool = False):
    B = draw(st.integers(1, 2))
    H_kv = draw(st.integers(1, 2))
    H = H_kv * draw(st.sampled_from([1, 2, 3]))
    S = draw(st.integers(1, max_seq_len))
    D = draw(st.sampled_from([4, 8]))
    chunk_size, top_k, granularity = draw(chunking(S))
    if token_only:
        granularity = "token"
    q, k, v = random_inputs(draw(st.integers(0, 2**31 - 1)), B, H, H_kv, S, D)
    return Problem(q, k, v, chunk_size, top_k, granularity, draw(document_ids(B, S)))


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
    return Problem(q, k, v, chunk_size, top_k, granularity, draw(document_ids(B, S)))
