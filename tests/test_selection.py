"""The gate: which chunks each query attends, against the brute-force oracle."""

import torch
from hypothesis import given

import oracle
from flexmoba import dense_moba_mask, moba_selection, select_chunks
from strategies import problems


def causal_same_document(problem):
    B, _, S, _ = problem.q.shape
    pos = torch.arange(S)
    causal = pos[None, :] <= pos[:, None]
    if problem.document_ids is None:
        return causal.expand(B, 1, S, S)
    ids = problem.document_ids
    return (causal & (ids[:, :, None] == ids[:, None, :]))[:, None]


def local_chunk_of(problem):
    """[B, S] index of each position's chunk inside its document (via the oracle's runs)."""
    B, _, S, _ = problem.q.shape
    out = torch.zeros(B, S, dtype=torch.long)
    for b in range(B):
        ids = None if problem.document_ids is None else problem.document_ids[b]
        for start, end in oracle.documents(ids, S):
            out[b, start:end] = torch.arange(end - start) // problem.chunk_size
    return out


@given(problems())
def test_selection_equals_oracle(problem):
    got = dense_moba_mask(select_chunks(problem.q, problem.k, **problem.kwargs))
    expected = oracle.dense_mask(problem.q, problem.k, **problem.kwargs)
    assert torch.equal(got, expected), problem


@given(problems())
def test_each_query_selects_own_chunk_plus_top_k_minus_one_past(problem):
    chunks = moba_selection(problem.q, problem.k, **problem.kwargs)
    own = local_chunk_of(problem)[:, None, :]  # [B, 1, S]
    expected = torch.clamp(own, max=problem.top_k - 1) + 1
    assert torch.equal(chunks.sum(-1), expected.expand_as(chunks[..., 0]))
    assert chunks.gather(-1, own[..., None].expand(*chunks.shape[:3], 1)).all(), "own chunk always attended"
    future = torch.arange(chunks.shape[-1]) > own[..., None]
    assert not (chunks & future).any(), "a future chunk was selected"


@given(problems())
def test_short_sequences_are_full_causal(problem):
    S = problem.q.shape[2]
    problem.top_k = max(problem.top_k, -(-S // problem.chunk_size))  # chunk_size * top_k >= S
    mask = dense_moba_mask(select_chunks(problem.q, problem.k, **problem.kwargs))
    assert torch.equal(mask, causal_same_document(problem).expand_as(mask))


@given(problems())
def test_top_k_one_is_block_diagonal_causal(problem):
    problem.top_k = 1
    mask = dense_moba_mask(select_chunks(problem.q, problem.k, **problem.kwargs))
    chunk = local_chunk_of(problem)
    same_chunk = chunk[:, :, None] == chunk[:, None, :]
    expected = causal_same_document(problem) & same_chunk[:, None]
    assert torch.equal(mask, expected.expand_as(mask))


@given(problems())
def test_tile_granularity_shares_one_selection_per_tile(problem):
    if problem.granularity == "token":
        problem.granularity = problem.chunk_size
    g = problem.granularity
    chunks = moba_selection(problem.q, problem.k, **problem.kwargs)
    B, _, S, _ = problem.q.shape
    for b in range(B):
        ids = None if problem.document_ids is None else problem.document_ids[b]
        for start, end in oracle.documents(ids, S):
            for tile_start in range(start, end, g):
                tile = chunks[b, :, tile_start:min(tile_start + g, end)]
                assert (tile == tile[:, :1]).all(), (problem, tile_start)


@given(problems())
def test_gqa_gates_against_the_shared_kv_head(problem):
    group = problem.q.shape[1] // problem.k.shape[1]
    kwargs = problem.kwargs
    shared = moba_selection(problem.q, problem.k, **kwargs)
    repeated = moba_selection(problem.q, problem.k.repeat_interleave(group, dim=1), **kwargs)
    assert torch.equal(shared, repeated)


def test_selection_has_no_gradient_path():
    q = torch.randn(1, 2, 40, 8, requires_grad=True)
    k = torch.randn(1, 2, 40, 8, requires_grad=True)
    chunks = moba_selection(q, k, chunk_size=8, top_k=2)
    assert chunks.dtype == torch.bool and not chunks.requires_grad
    assert chunks.shape == (1, 2, 40, 5)
