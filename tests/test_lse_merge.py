"""The log-sum-exp merge, one slot at a time: the softmax-weighted sum of a query's slots and its
gradients, against the same sum written out with plain autograd over every slot at once."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexmoba.lse_merge import merge_by_lse


def merge_written_out(out, lse, rows, valid):
    """Every slot copied out at once, weighted by a softmax over the used slots (plain autograd)."""
    B, H, S, K = rows.shape
    H_kv, Dv = out.shape[1], out.shape[-1]
    index = rows.reshape(B, H_kv, -1)
    slot_lse = lse.gather(2, index).view(B, H, S, K).masked_fill(~valid, float("-inf"))
    slot_out = out.gather(2, index[..., None].expand(-1, -1, -1, Dv)).view(B, H, S, K, Dv)
    weights = torch.softmax(slot_lse, dim=-1)
    return (weights[..., None] * torch.where(valid[..., None], slot_out, 0.0)).sum(3)


def case(seed, B, H, H_kv, S, K, Dv, dtype=torch.float64):
    """Virtual rows: each used (query, slot) its own row in its KV head, shuffled, never row 0; unused
    slots point at row 0."""
    gen = torch.Generator().manual_seed(seed)
    G = H // H_kv
    L = G * S * K + 3  # three rows no slot reads
    out = torch.randn(B, H_kv, L, Dv, generator=gen, dtype=dtype)
    lse = 3 * torch.randn(B, H_kv, L, generator=gen, dtype=dtype)
    rows = torch.stack([torch.randperm(L - 1, generator=gen)[: G * S * K] + 1 for _ in range(B * H_kv)])
    rows = rows.view(B, H, S, K)
    valid = torch.rand(B, H, S, K, generator=gen) < 0.6
    valid[..., 0] = True  # every query has its own chunk
    rows = torch.where(valid, rows, 0)
    return out, lse, rows, valid


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from([(1, 1, 1), (2, 4, 2), (1, 3, 1)]), st.integers(1, 9),
       st.integers(1, 4))
def test_forward_and_gradients_equal_the_merge_written_out(seed, heads, S, K):
    B, H, H_kv = heads
    out, lse, rows, valid = case(seed, B, H, H_kv, S, K, Dv=3)
    grad = torch.randn(B, H, S, 3, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)

    def result(fn):
        o, l_ = out.clone().requires_grad_(), lse.clone().requires_grad_()
        merged = fn(o, l_, rows, valid)
        merged.backward(grad)
        return merged.detach(), o.grad, l_.grad

    for got, want in zip(result(merge_by_lse), result(merge_written_out), strict=True):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_gradcheck():
    out, lse, rows, valid = case(3, 1, 4, 2, 5, 3, Dv=2)
    assert torch.autograd.gradcheck(lambda o, l_: merge_by_lse(o, l_, rows, valid),
                                    (out.requires_grad_(), lse.requires_grad_()))


def test_an_unused_slot_s_row_never_reaches_the_output_or_its_gradient():
    """Unused slots point at row 0; a NaN there must stay out of every other query."""
    out, lse, rows, valid = case(4, 1, 2, 1, 6, 3, Dv=2)
    assert (~valid).any() and (rows[valid] != 0).all()  # row 0 is read only by unused slots
    out[:, :, 0] = float("nan")
    lse[:, :, 0] = float("nan")
    o, l_ = out.clone().requires_grad_(), lse.clone().requires_grad_()
    merged = merge_by_lse(o, l_, rows, valid)
    merged.sum().backward()
    assert torch.isfinite(merged).all()
    assert torch.isfinite(o.grad[:, :, 1:]).all() and torch.isfinite(l_.grad[:, :, 1:]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_low_precision_outputs_are_summed_in_fp32_and_returned_in_their_dtype(dtype):
    out, lse, rows, valid = case(5, 1, 2, 2, 8, 3, Dv=4, dtype=torch.float32)
    low = out.to(dtype)
    merged = merge_by_lse(low, lse, rows, valid)
    assert merged.dtype == dtype
    want = merge_written_out(low.double(), lse.double(), rows, valid)
    torch.testing.assert_close(merged.double(), want.to(dtype).double(), atol=1e-2 if dtype == torch.bfloat16 else 1e-6,
                               rtol=1e-2 if dtype == torch.bfloat16 else 1e-6)


def test_a_gradient_laid_out_as_the_model_lays_it_out_is_taken():
    """A model's attention output is often read as ``[B, S, H, Dv]``: its gradient arrives transposed."""
    out, lse, rows, valid = case(6, 1, 4, 2, 5, 3, Dv=2)
    grad = torch.randn(1, 5, 4, 2, dtype=torch.float64).transpose(1, 2)
    assert not grad.is_contiguous()
    o = out.clone().requires_grad_()
    merge_by_lse(o, lse, rows, valid).backward(grad)
    want = out.clone().requires_grad_()
    merge_written_out(want, lse, rows, valid).backward(grad)
    torch.testing.assert_close(o.grad, want.grad)


def attended(q, k, v):
    """``(out [N, Dv], lse [N])`` of ``q: [N, D]`` over ``k, v: [N, M, *]``, fp32; a key of -inf logit adds nothing."""
    logits = torch.einsum("nd,nmd->nm", q, k)
    lse = torch.logsumexp(logits, dim=-1)
    return torch.einsum("nm,nmd->nd", torch.softmax(logits, dim=-1), v), lse


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 6), m_a=st.integers(1, 5), m_b=st.integers(1, 5))
def test_every_merge_of_two_parts_equals_one_softmax_over_both(seed, n, m_a, m_b):
    from flexmoba.lse_merge import merge_in_place, merge_into, merge_two

    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((n, 4), (n, m_a + m_b, 4),
                                                                                    (n, m_a + m_b, 3)))
    whole = attended(q, k, v)
    a, b = attended(q, k[:, :m_a], v[:, :m_a]), attended(q, k[:, m_a:], v[:, m_a:])
    for got in (merge_two(a, b), in_place(merge_in_place, a, b)):
        torch.testing.assert_close(got, whole)
    # merge_into: part b of some queries only, into a buffer of every query
    chosen = torch.randperm(n, generator=g)[: max(1, n // 2)]
    out, lse = a[0].clone(), a[1].clone()
    merge_into(out, lse, chosen, b[0][chosen], b[1][chosen])
    expected_out, expected_lse = a[0].clone(), a[1].clone()
    expected_out[chosen], expected_lse[chosen] = whole[0][chosen], whole[1][chosen]
    torch.testing.assert_close((out, lse), (expected_out, expected_lse))


def in_place(merge, a, b):
    out, lse = a[0].clone(), a[1].clone()
    merge(out, lse, *b)
    return out, lse


def test_merge_pairs_equals_one_softmax_over_each_query_s_own_part_and_its_pairs():
    from flexmoba.lse_merge import merge_pairs

    g = torch.Generator().manual_seed(0)
    n, pairs = 4, [0, 2, 2, 3, 0]  # query of each pair; query 1 has none
    q = torch.randn(n, 4, generator=g, dtype=torch.float64)
    own_k, own_v = torch.randn(n, 3, 4, generator=g, dtype=torch.float64), torch.randn(n, 3, 2, generator=g,
                                                                                         dtype=torch.float64)
    pair_k = torch.randn(len(pairs), 2, 4, generator=g, dtype=torch.float64)
    pair_v = torch.randn(len(pairs), 2, 2, generator=g, dtype=torch.float64)
    query = torch.tensor(pairs)
    own_out, own_lse = attended(q, own_k, own_v)
    pair_out, pair_lse = attended(q[query], pair_k, pair_v)
    pair_lse[1] = float("-inf")  # a pair that attends nothing adds nothing
    out, lse = merge_pairs(own_out.clone(), own_lse, query, pair_lse, [pair_out[:2].clone(), pair_out[2:].clone()])
    for i in range(n):
        mine = [j for j, p in enumerate(pairs) if p == i and j != 1]
        keys = torch.cat([own_k[i], *pair_k[mine]])[None]
        values = torch.cat([own_v[i], *pair_v[mine]])[None]
        expected = attended(q[i:i + 1], keys, values)
        torch.testing.assert_close((out[i:i + 1].double(), lse[i:i + 1]), expected, rtol=1e-5, atol=1e-6)  # fp32 out
