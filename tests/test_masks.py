"""Every form of the mask in ``flexmoba/masks.py`` against its definition, written out one (query, key) pair at a
time: MoBA's over a sequence, over a rank's rows, over a decode step; full attention's within documents and over a
left-padded cache. The selections come from the gate; what is tested is the mask each form builds from them."""

from __future__ import annotations

import itertools

import pytest
import torch

from flexmoba import MobaSpec, select_chunks
from flexmoba.decode import gate_step
from flexmoba.gate import select_local_chunks
from flexmoba.kv_cache import ChunkKeySums
from flexmoba.layout import document_starts
from flexmoba.masks import (
    cache_causal_mask,
    causal_document_rows,
    decode_moba_mask,
    dense_moba_mask,
    local_moba_mask,
)

CHUNK, TOP_K = 4, 2
DOCUMENTS = torch.tensor([[0] * 9 + [1] * 7 + [2] * 6, [5] * 22])  # [B, S]: three documents, then one


def qk(S: int = 22, H: int = 4, H_kv: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, H, S, 8, generator=g), torch.randn(2, H_kv, S, 8, generator=g)


def moba_attends(chunks, doc_q: int, doc_s: int, t: int, s: int) -> bool:
    """The definition: same document, not after the query, in a chunk it selected (counted from its document)."""
    return doc_q == doc_s and s <= t and bool(chunks[(s - doc_s) // CHUNK])


@pytest.mark.parametrize("documents", [False, True])
def test_the_dense_mask_is_the_predicate_pair_by_pair(documents):
    q, k = qk()
    ids = DOCUMENTS if documents else None
    selection = select_chunks(q, k, MobaSpec(CHUNK, TOP_K), document_ids=ids)
    starts = document_starts(ids) if documents else torch.zeros(2, 22, dtype=torch.long)
    mask = dense_moba_mask(selection)
    for b, h, t, s in itertools.product(range(2), range(4), range(22), range(22)):
        chunks = selection.chunks[b, h, t]
        assert bool(mask[b, h, t, s]) == moba_attends(chunks, int(starts[b, t]), int(starts[b, s]), t, s), (b, h, t, s)


@pytest.mark.parametrize("query_start", [0, 5, 13])
def test_a_rank_s_rows_are_the_predicate_at_their_global_positions(query_start):
    q, k = qk()
    rows = q[:, :, query_start:query_start + 6]
    selection = select_local_chunks(rows, k[:, :, :query_start + 6], MobaSpec(CHUNK, TOP_K), query_start,
                                    DOCUMENTS[:, :query_start + 6])
    starts = document_starts(DOCUMENTS)
    mask = local_moba_mask(selection, query_start, query_start + 6)
    assert mask.shape == (2, 4, 6, query_start + 6)
    for b, h, i, s in itertools.product(range(2), range(4), range(6), range(query_start + 6)):
        t = query_start + i
        expected = moba_attends(selection.chunks[b, h, i], int(starts[b, t]), int(starts[b, s]), t, s)
        assert bool(mask[b, h, i, s]) == expected, (b, h, i, s)


@pytest.mark.parametrize("start", [None, torch.tensor([0, 3])], ids=["no padding", "left padding"])
@pytest.mark.parametrize("new", [1, 5])
def test_a_decode_step_s_mask_is_the_predicate_of_each_new_query(start, new):
    q, k = qk(S=19)
    sums = ChunkKeySums.from_keys(k, CHUNK, start=start)
    step = gate_step(q[:, :, -new:], k, k, sums, TOP_K, 1.0)
    mask = decode_moba_mask(step)
    T = 19
    first = [0, 0] if start is None else start.tolist()
    for b, h, i, s in itertools.product(range(2), range(4), range(new), range(T)):
        t = T - new + i
        if t < first[b]:
            expected = s == t  # a padding query attends only itself
        else:
            own = (t - first[b]) // CHUNK
            chosen = {own} | {int(c) for c, used in zip(step.past[b, h, i], step.valid[b, h, i], strict=True) if used}
            expected = first[b] <= s <= t and (s - first[b]) // CHUNK in chosen
        assert bool(mask[b, h, i, s]) == expected, (b, h, i, s)


@pytest.mark.parametrize("query_start", [0, 7])
def test_full_attention_within_documents_is_the_predicate(query_start):
    starts = document_starts(DOCUMENTS)
    mask = causal_document_rows(query_start, 6, query_start + 6, starts[:, query_start:query_start + 6])
    for b, i, s in itertools.product(range(2), range(6), range(query_start + 6)):
        t = query_start + i
        assert bool(mask[b, 0, i, s]) == (int(starts[b, t]) <= s <= t), (b, i, s)


def test_full_attention_over_a_left_padded_cache_is_the_predicate():
    start, T, new = torch.tensor([0, 4, 9]), 10, 7
    mask = cache_causal_mask(start, T, new, start.device)
    for b, i, s in itertools.product(range(3), range(new), range(T)):
        t = T - new + i
        expected = s == t if t < int(start[b]) else int(start[b]) <= s <= t
        assert bool(mask[b, i, s]) == expected, (b, i, s)
