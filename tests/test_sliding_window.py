"""Sliding-window causal attention (flexmoba/sliding_window.py): equal to a dense masked softmax, forward and
backward, for drawn shapes, windows, offsets and GQA; transformers' window convention, off-by-one included;
memory linear in S (no call reads more keys than a block's windows span)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from flexmoba.sliding_window import (
    KEY_ALIGNMENT,
    keys_attended_sliding,
    sliding_window_attention,
    sliding_window_mask,
)


def dense_reference(q, k, v, window: int, scale: float | None = None, query_start: int = 0) -> torch.Tensor:
    """The whole ``[S, T]`` score matrix, masked by the definition ``t - W < s <= t``, softmax, values."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    t = query_start + torch.arange(q.shape[2])[:, None]
    s = torch.arange(k.shape[2])[None, :]
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    scores = scores.masked_fill(~((s <= t) & (s > t - window)), float("-inf"))
    return scores.softmax(-1) @ v


@st.composite
def problems(draw):
    """fp64 q, k, v (GQA or not), the queries at an offset of the keys, a window and a block size."""
    B, H_kv, G = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    S, later_keys = draw(st.integers(1, 40)), draw(st.integers(0, 5))
    # Far enough in, key slices start past 0 (at a multiple of KEY_ALIGNMENT): the slicing is tested too.
    query_start = draw(st.one_of(st.integers(0, 30), st.integers(KEY_ALIGNMENT - 50, 2 * KEY_ALIGNMENT + 10)))
    window, block = draw(st.integers(1, 45)), draw(st.integers(1, 17))
    D, seed = draw(st.sampled_from([4, 8])), draw(st.integers(0, 2**16))
    T = query_start + S + later_keys  # keys after the last query (as under context parallelism) are never read
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H_kv * G, S, D, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(B, H_kv, T, D, generator=gen, dtype=torch.float64) for _ in range(2))
    scale = draw(st.sampled_from([None, 0.3]))
    return q, k, v, dict(window=window, scale=scale, query_start=query_start), block


@given(problems())
def test_equals_the_dense_masked_reference_forward_and_backward(problem):
    q, k, v, kwargs, block = problem
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ours = sliding_window_attention(*leaves, block_size=block, **kwargs)
    grad_out = torch.randn_like(ours)
    ours_grads = torch.autograd.grad((ours * grad_out).sum(), leaves)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    expected = dense_reference(*leaves, **kwargs)
    expected_grads = torch.autograd.grad((expected * grad_out).sum(), leaves)
    torch.testing.assert_close(ours, expected, atol=1e-12, rtol=1e-10)
    for got, want in zip(ours_grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


def test_the_window_is_transformers_convention():
    """Key s is in the window of query t iff t - W < s <= t: the query itself and the W - 1 keys before it,
    as transformers' sliding_window_causal_mask_function (Gemma's and Mistral's local layers)."""
    assert sliding_window_mask(torch.tensor([5]), torch.arange(8), 3).nonzero()[:, 1].tolist() == [3, 4, 5]
    masking_utils = pytest.importorskip("transformers.masking_utils")
    for window in (1, 3, 8):
        theirs = masking_utils.sliding_window_causal_mask_function(window)
        t, s = torch.arange(20)[:, None], torch.arange(20)[None, :]
        expected = theirs(torch.tensor(0), torch.tensor(0), t, s)
        assert torch.equal(sliding_window_mask(torch.arange(20), torch.arange(20), window), expected)


def test_each_query_averages_exactly_its_window():
    """Zero queries weigh their allowed keys alike; one-hot values show which keys those are."""
    S, window = 12, 4
    q = torch.zeros(1, 1, S, 2)
    k = torch.randn(1, 1, S, 2)
    v = torch.eye(S)[None, None]
    out = sliding_window_attention(q, k, v, window, block_size=5)[0, 0]
    for t in range(S):
        attended = list(range(max(0, t - window + 1), t + 1))
        assert out[t].nonzero().flatten().tolist() == attended
        torch.testing.assert_close(out[t, attended], torch.full((len(attended),), 1 / len(attended)))


def test_a_window_covering_the_sequence_is_causal_attention():
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 50, 8, generator=gen), *torch.randn(2, 2, 2, 50, 8, generator=gen)
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(sliding_window_attention(q, k, v, 50), causal, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(sliding_window_attention(q, k, v, 49), causal, atol=1e-4)


def test_rank_slices_at_their_offsets_equal_the_whole_sequence():
    """Context parallelism's computation: each rank's queries over all keys at its global offset."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 4, 96, 8, generator=gen), *torch.randn(2, 1, 2, 96, 8, generator=gen)
    whole = sliding_window_attention(q, k, v, 20)
    slices = [sliding_window_attention(q[:, :, r * 24:(r + 1) * 24], k, v, 20, query_start=r * 24) for r in range(4)]
    torch.testing.assert_close(torch.cat(slices, 2), whole, atol=1e-6, rtol=1e-6)


def test_memory_is_linear_no_call_reads_more_than_a_block_spans(monkeypatch):
    S, window, block = 4096, 64, 128
    spans = []
    sdpa = F.scaled_dot_product_attention

    def counting(q, k, v, **kwargs):
        spans.append((q.shape[2], k.shape[2], tuple(kwargs["attn_mask"].shape)))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting)
    q, k, v = torch.randn(1, 2, S, 4), torch.randn(1, 1, S, 4), torch.randn(1, 1, S, 4)
    sliding_window_attention(q, k, v, window, block_size=block)
    assert len(spans) == S // block
    assert max(keys for _, keys, _ in spans) <= block + window - 1 + KEY_ALIGNMENT - 1
    assert all(mask == (queries, keys) for queries, keys, mask in spans)


def test_pairs_in_closed_form_equal_the_mask():
    for S, window in ((1, 1), (7, 3), (10, 10), (10, 30), (100, 16)):
        counted = int(sliding_window_mask(torch.arange(S), torch.arange(S), window).sum())
        assert keys_attended_sliding(S, window) == counted


def test_bad_arguments_are_refused_by_name():
    q, k, v = torch.randn(1, 2, 8, 4), torch.randn(1, 1, 8, 4), torch.randn(1, 1, 8, 4)
    with pytest.raises(ValueError, match="window must be >= 1"):
        sliding_window_attention(q, k, v, 0)
    with pytest.raises(TypeError, match="window must be an int"):
        sliding_window_attention(q, k, v, 2.0)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        sliding_window_attention(q, k, v, 2, block_size=0)
    with pytest.raises(ValueError, match="reach past the 8 keys"):
        sliding_window_attention(q, k, v, 2, query_start=1)
