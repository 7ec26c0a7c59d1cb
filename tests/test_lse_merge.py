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
