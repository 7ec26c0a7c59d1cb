"""The FlexAttention stand-in computes what the compiled kernel computes, from the block tables.

It visits only listed blocks and skips ``mask_mod`` on full ones (so a table bug shows,
where eager flex, reading the mask_mod alone, hides it), returns flex's natural-log LSE, and
is differentiable through both. Slow: it equals compiled CPU flex on the plan's and the
union mask's shapes.
"""

import pytest
import torch
from flex_standin import flex_standin, listed_blocks
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from flexmoba import compiled_flex_attention, moba_block_mask, moba_flex_plan

import oracle
from strategies import random_inputs

CHUNK, TOP_K, BLOCK = 8, 3, 8
TOL = dict(atol=1e-5, rtol=1e-5)


def union_case(seed=0):
    q, k, v = random_inputs(seed, 1, 2, 1, 45, 4)  # 45: a ragged last block
    return q, k, v, moba_block_mask(q, k, chunk_size=CHUNK, top_k=TOP_K, block_size=BLOCK)


def union_oracle(q, k, v):
    return oracle.attention(q, k, v, chunk_size=CHUNK, top_k=TOP_K)


def dense_lse(q, k, mask, scale):
    """``[B, H, L]`` natural-log LSE of the allowed scores, by torch.logsumexp (GQA by repetition)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    return scores.masked_fill(~mask, float("-inf")).logsumexp(-1)


def test_output_and_natural_log_lse_equal_eager_flex_and_the_oracle():
    q, k, v, mask = union_case()
    out, aux = flex_standin(q, k, v, block_mask=mask, enable_gqa=True, return_aux=AuxRequest(lse=True))
    eager_out, eager_aux = flex_attention(q, k, v, block_mask=mask, enable_gqa=True, return_aux=AuxRequest(lse=True))
    torch.testing.assert_close(out.double(), union_oracle(q, k, v), **TOL)
    torch.testing.assert_close(out, eager_out, **TOL)
    dense = oracle.dense_mask(q, k, CHUNK, TOP_K)
    torch.testing.assert_close(aux.lse.double(), dense_lse(q, k, dense, 4 ** -0.5), **TOL)
    torch.testing.assert_close(aux.lse, eager_aux.lse, **TOL)


def tables_with(block_mask: BlockMask, partial: torch.Tensor, full: torch.Tensor) -> BlockMask:
    """``block_mask`` with other dense block maps ``[B, H, T, N]`` (partial, full)."""
    def ordered(blocks):
        count = blocks.sum(-1, dtype=torch.int32)
        indices = torch.sort((~blocks).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
        return count, indices

    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=block_mask.BLOCK_SIZE,
                                    mask_mod=block_mask.mask_mod, seq_lengths=block_mask.seq_lengths)


def dense_maps(block_mask: BlockMask):
    n = block_mask.kv_indices.shape[-1]
    return (listed_blocks(block_mask.kv_num_blocks, block_mask.kv_indices, n),
            listed_blocks(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, n))


def test_tables_rebuilt_from_dense_maps_are_the_same_mask():
    """The test's own table surgery is sound: unchanged maps give the oracle's output."""
    q, k, v, mask = union_case()
    same = tables_with(mask, *dense_maps(mask))
    torch.testing.assert_close(flex_standin(q, k, v, block_mask=same, enable_gqa=True).double(),
                               union_oracle(q, k, v), **TOL)


def test_a_partial_block_marked_full_shows_in_the_standin_not_in_eager_flex():
    q, k, v, mask = union_case()
    partial, full = dense_maps(mask)
    where = partial.nonzero()[-1].tolist()  # the last query tile's last partial block
    partial[tuple(where)], full[tuple(where)] = False, True
    planted = tables_with(mask, partial, full)
    expected = union_oracle(q, k, v)
    eager = flex_attention(q, k, v, block_mask=planted, enable_gqa=True)
    torch.testing.assert_close(eager.double(), expected, **TOL)  # eager flex reads only the mask_mod
    got = flex_standin(q, k, v, block_mask=planted, enable_gqa=True).double()
    assert (got - expected).abs().max() > 1e-2


def test_an_unlisted_block_is_never_visited():
    q, k, v, mask = union_case()
    partial, full = dense_maps(mask)
    first = int((partial | full)[0, 0, -1].nonzero()[0])  # the last query tile's first listed key block
    partial[0, 0, -1, first] = full[0, 0, -1, first] = False
    dropped = tables_with(mask, partial, full)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=dropped, enable_gqa=True).double(),
                               union_oracle(q, k, v), **TOL)
    got = flex_standin(q, k, v, block_mask=dropped, enable_gqa=True).double()
    assert (got[0, 0, 40:] - union_oracle(q, k, v)[0, 0, 40:]).abs().max() > 1e-2


def test_gradients_through_output_and_lse_equal_plain_autograd():
    q, k, v, mask = union_case(seed=3)
    dense = oracle.dense_mask(q, k, CHUNK, TOP_K)
    g_out, g_lse = torch.randn(q.shape, dtype=torch.float64), torch.randn(q.shape[:3], dtype=torch.float64)
    scale = 0.7

    def grads(fn):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = fn(*inputs)
        ((out.double() * g_out).sum() + (lse.double() * g_lse).sum()).backward()
        return [t.grad for t in inputs]

    def standin(q, k, v):
        out, aux = flex_standin(q, k, v, block_mask=mask, scale=scale, enable_gqa=True,
                                return_aux=AuxRequest(lse=True))
        return out, aux.lse

    def plain(q, k, v):
        group = q.shape[1] // k.shape[1]
        scores = (q.double() @ k.double().repeat_interleave(group, 1).transpose(-1, -2)) * scale
        scores = scores.masked_fill(~dense, float("-inf"))
        return scores.softmax(-1) @ v.double().repeat_interleave(group, 1), scores.logsumexp(-1)

    for got, want in zip(grads(standin), grads(plain), strict=True):
        torch.testing.assert_close(got.double(), want.double(), atol=1e-5, rtol=1e-5)


def test_a_row_that_attends_nothing_is_zero_with_lse_minus_inf_and_finite_gradients():
    q, k, v = (t.requires_grad_() for t in random_inputs(0, 1, 1, 1, 8, 4))
    none = BlockMask.from_kv_blocks(torch.zeros(1, 1, 1, dtype=torch.int32), torch.zeros(1, 1, 1, 1, dtype=torch.int32),
                                    BLOCK_SIZE=8, seq_lengths=(8, 8))
    out, aux = flex_standin(q, k, v, block_mask=none, return_aux=AuxRequest(lse=True))
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(aux.lse).all()
    (out.sum() + aux.lse.clamp(min=-1).sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.slow
@pytest.mark.parametrize("sink", [True, False], ids=["plan-with-sink", "plan-without-sink"])
def test_equals_compiled_cpu_flex_on_the_plan(sink):
    """The plan's own call: virtual queries, the interval mask_mod (and the sink's score_mod)."""
    q, k, v = random_inputs(1, 1, 2, 1, 96, 8)
    plan = moba_flex_plan(q, k, chunk_size=16, top_k=3, block_size=16, sink=sink)
    virtual_q = plan.gather_queries(q)
    if sink:
        with torch.no_grad():
            got = plan.attention(q, k, v, flex=flex_standin)
            want = plan.attention(q, k, v, flex=compiled_flex_attention())
    else:  # compiled CPU flex returns no LSE: compare the outputs of the plan's flex call
        with torch.no_grad():
            got = flex_standin(virtual_q, k, v, block_mask=plan.block_mask)
            want = compiled_flex_attention()(virtual_q, k, v, block_mask=plan.block_mask)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.slow
def test_equals_compiled_cpu_flex_on_the_union_mask():
    q, k, v = random_inputs(2, 1, 2, 1, 96, 8)
    mask = moba_block_mask(q, k, chunk_size=16, top_k=3, block_size=16)
    with torch.no_grad():
        got = flex_standin(q, k, v, block_mask=mask, enable_gqa=True)
        want = compiled_flex_attention()(q, k, v, block_mask=mask, enable_gqa=True)
    torch.testing.assert_close(got, want, **TOL)
