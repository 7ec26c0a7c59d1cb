"""The gather backend's batching: a chunk's queries split into blocks (or all chunks' blocks in one
batch), gradients summed back."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flexmoba import moba_reference, select_chunks
from flexmoba.backends.gather import kernel as gather
from flexmoba.dense import unfused_pieces
from flexmoba.tuning import tuning_for, use_tuning

from strategies import problems


@given(problems(), st.integers(1, 9), st.booleans(), st.booleans(), st.booleans(), st.booleans())
def test_any_query_block_gives_reference_gradients(problem, query_block, fused, batched, split_own, pieces):
    """Small blocks put several blocks (and a remainder) in one call; dk and dv are their sum.
    ``batched``: all past pairs as one batch of blocks, or one call per chunk (the long-sequence path).
    ``split_own``: every even own chunk as two causal halves and the second half over the first.
    ``pieces``: the unfused math one item of a batch at a time (its memory bound at the extreme)."""
    grad_out = torch.randn(problem.q.shape, generator=torch.Generator().manual_seed(0))
    cpu = tuning_for("cpu")
    with use_tuning(cpu, gather_fused_kernel=fused,
                    gather_batched_pairs_max_bytes=cpu.gather_batched_pairs_max_bytes if batched else 0,
                    gather_split_own_min=2 if split_own else cpu.gather_split_own_min,
                    gather_unfused_scores=1 if pieces else cpu.gather_unfused_scores):
        inputs = [t.clone().requires_grad_() for t in (problem.q, problem.k, problem.v)]
        selection = select_chunks(inputs[0], inputs[1], **problem.kwargs)
        out = gather.gather_moba_attention(*inputs, selection, query_block=query_block)
        got = torch.autograd.grad((out * grad_out).sum(), inputs)
    inputs = [t.clone().requires_grad_() for t in (problem.q, problem.k, problem.v)]
    ref = moba_reference(*inputs, **problem.kwargs)
    expected = torch.autograd.grad((ref * grad_out).sum(), inputs)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, atol=2e-5, rtol=2e-5)


def test_row_blocks_cover_every_row_once():
    for n in range(0, 30):
        for block in (1, 4, 7, 128):
            rows = [r for first, batch, size in gather._row_blocks(n, block)
                    for r in range(first, first + batch * size)]
            assert rows == list(range(n))


@given(problems(token_only=True), st.integers(1, 5))
def test_pair_blocks_hold_every_past_pair_once_and_pad_with_their_segment(problem, query_block):
    """Block rows minus padding are the sorted pairs, each exactly once. Blocks run size after size,
    segment after segment; each holds its segment's queries (padding repeats one) against a copy of
    that segment's keys. A segment takes as many of the largest size as fit, then the remainder in
    binary, so its padding stays under one unit."""
    B, H_kv, S = problem.k.shape[:3]
    selection = select_chunks(problem.q, problem.k, **problem.kwargs)
    pairs = gather.past_pairs(selection, H_kv)
    chunk = selection.layout.chunk_size
    blocks = gather.pair_blocks(pairs, S, chunk, query_block, 2 * problem.k.shape[-1])
    if blocks is None:  # no past pairs, or a segment shorter than a chunk (documents)
        assert not pairs.segments or any(seg.length != chunk for seg in pairs.segments)
        return
    real = torch.ones(len(blocks.query_of_row), dtype=torch.bool)
    real[blocks.padding] = False
    assert sorted(blocks.query_of_row[real].tolist()) == sorted(pairs.query.tolist()), "every pair once"
    largest = gather.BLOCK_UNITS[0]
    units = [-(-seg.count // query_block) for seg in pairs.segments]
    per_segment = [[n // largest] + [int(bool(n % largest & u)) for u in gather.BLOCK_UNITS[1:]] for n in units]
    row = key = 0
    sizes = []
    for size, unit in enumerate(gather.BLOCK_UNITS):
        R = unit * query_block
        n_blocks = 0
        for seg, counts in zip(pairs.segments, per_segment, strict=True):
            in_segment = set(pairs.query[seg.offset: seg.offset + seg.count].tolist())
            for _ in range(counts[size]):
                assert set(blocks.query_of_row[row: row + R].tolist()) <= in_segment, "a segment's queries only"
                want_keys = seg.kv_row * S + seg.start + torch.arange(chunk)
                assert torch.equal(blocks.key_of_row[key: key + chunk], want_keys), "the segment's keys"
                row, key, n_blocks = row + R, key + chunk, n_blocks + 1
        if n_blocks:
            sizes.append((R, n_blocks))
    assert row == len(blocks.query_of_row) and key == len(blocks.key_of_row)
    assert blocks.sizes == tuple(sizes)


def test_padded_own_chunks_of_documents_keep_large_logits_finite_and_exact():
    """With documents, own chunks are padded to a whole chunk and run as one causal call. A short last
    chunk's padding rows must carry finite results even where logits are far above 88 (exp overflows
    fp32), or 0 * inf would reach dk and dv; the gradients equal the reference's."""
    generator = torch.Generator().manual_seed(3)
    B, H, H_kv, S, D, chunk = 2, 4, 2, 40, 8, 8
    q, k, v = (torch.randn(B, heads, S, D, generator=generator) for heads in (H, H_kv, H_kv))
    q, k = q * 12, k * 12  # logits of several hundred
    document_ids = torch.zeros(B, S, dtype=torch.long)
    document_ids[:, 11:] = 1  # row 0: chunks of 8 and 3 positions, then of 8, 8, 8 and 5
    document_ids[1, 29:] = 2  # row 1: 8 and 3, then 8, 8 and 2, then 8 and 3
    grad_out = torch.randn(q.shape, generator=generator)
    kwargs = dict(chunk_size=chunk, top_k=2, document_ids=document_ids)
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    selection = select_chunks(inputs[0], inputs[1], **kwargs)
    assert selection.layout.has_documents
    out = gather.gather_moba_attention(*inputs, selection)
    got = torch.autograd.grad((out * grad_out).sum(), inputs)
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = moba_reference(*inputs, **kwargs)
    expected = torch.autograd.grad((ref * grad_out).sum(), inputs)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    for g, e in zip(got, expected, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, e, atol=1e-3, rtol=1e-4)


@given(problems())
def test_one_plan_serves_any_values_and_gradients(problem):
    """A plan reads the selection and the shapes only: built once, it serves calls with other values
    (as a benchmark's prebuilt plan and a training step's backward do), each equal to the reference."""
    selection = select_chunks(problem.q, problem.k, **problem.kwargs)
    plan = gather.gather_plan(selection, problem.k, problem.v)
    for seed in (0, 1):
        v = torch.randn(problem.v.shape, generator=torch.Generator().manual_seed(seed))
        inputs = [t.clone().requires_grad_() for t in (problem.q, problem.k, v)]
        out = plan.attention(*inputs, scale=problem.scale)
        got = torch.autograd.grad(out.square().sum(), inputs)
        inputs = [t.clone().requires_grad_() for t in (problem.q, problem.k, v)]
        ref = moba_reference(*inputs, **problem.attention_kwargs)
        expected = torch.autograd.grad(ref.square().sum(), inputs)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, atol=5e-5, rtol=5e-5)


def test_a_plan_refuses_queries_and_keys_of_other_shapes():
    q, k, v = torch.randn(1, 2, 24, 4), torch.randn(1, 1, 24, 4), torch.randn(1, 1, 24, 4)
    plan = gather.gather_plan(select_chunks(q, k, chunk_size=4, top_k=2), k, v)
    with pytest.raises(ValueError, match=r"q is \[B, H, S\] = \[1, 2, 16\] but the plan is for \[1, 2, 24\]"):
        plan.attention(q[:, :, :16], k, v)
    with pytest.raises(ValueError, match="k and v must hold the plan's 24 keys, got 24 and 20"):
        plan.attention(q, k, v[:, :, :20])


@pytest.mark.parametrize("n, per_item, budget", [(10, 4, 1), (10, 4, 12), (10, 4, 2**26), (0, 4, 1), (3, 10**9, 2**26)])
def test_unfused_pieces_cover_the_batch_once_within_the_budget(n, per_item, budget):
    with use_tuning("cuda", gather_unfused_scores=budget):
        pieces = unfused_pieces(n, per_item, torch.device("cpu"))
    assert [i for first, end in pieces for i in range(first, end)] == list(range(n))
    assert all(end - first <= max(1, budget // per_item) for first, end in pieces)
