"""MoBA decoding with a KV cache equals MoBA over the whole sequence, row by row."""

import pytest
import torch
import torch.nn.functional as F

from flexmoba import decode, moba_reference
from flexmoba.decode import ChunkKeySums, MoBAKVCache, moba_decode_attention

CHUNK, TOP_K = 8, 3


def qkv(B=2, H=4, H_kv=2, S=44, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, D, generator=g)
    k = torch.randn(B, H_kv, S, D, generator=g)
    v = torch.randn(B, H_kv, S, D, generator=g)
    return q, k, v


def padding_ids(start, S):
    """document_ids putting each row's left padding in its own document."""
    return (torch.arange(S)[None, :] >= start[:, None]).long()


def run_in_pieces(q, k, v, pieces, start=None, **kwargs):
    """Feed the sequence to a MoBAKVCache piece by piece; attend each piece's queries."""
    cache = MoBAKVCache(CHUNK, start=start)
    outs, t = [], 0
    for n in pieces:
        cache.update(k[:, :, t:t + n], v[:, :, t:t + n])
        outs.append(moba_decode_attention(q[:, :, t:t + n], cache, top_k=TOP_K, **kwargs))
        t += n
    assert t == q.shape[2]
    return torch.cat(outs, dim=2)


def test_moba_is_active_at_these_sizes():
    # Otherwise every comparison below could pass with plain causal attention.
    q, k, v = qkv()
    ref = moba_reference(q, k, v, chunk_size=CHUNK, top_k=TOP_K)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert (ref - full).abs().max() > 1e-2


@pytest.mark.parametrize("start", [None, torch.tensor([0, 5])])
def test_running_chunk_means_equal_recomputed(start):
    _, k, _ = qkv(S=37)
    sums = ChunkKeySums(2, 2, 16, CHUNK, start=start)
    for lo, hi in [(0, 1), (1, 9), (9, 10), (10, 30), (30, 37)]:
        sums.update(k[:, :, lo:hi])
    means = sums.means()
    first = torch.zeros(2, dtype=torch.long) if start is None else start
    for b in range(2):
        for j, lo in enumerate(range(int(first[b]), 37, CHUNK)):
            expected = k[b, :, lo:lo + CHUNK].mean(dim=1)
            torch.testing.assert_close(means[b, :, j], expected, rtol=1e-6, atol=1e-6)
    assert sums.length == 37
    torch.testing.assert_close(sums.last_key, k[:, :, -1])


@pytest.mark.parametrize("H_kv", [2, 4], ids=["gqa", "mha"])
def test_token_by_token_decode_equals_reference_rows(H_kv):
    q, k, v = qkv(H_kv=H_kv)
    ref = moba_reference(q, k, v, chunk_size=CHUNK, top_k=TOP_K)
    prefill = 13
    out = run_in_pieces(q, k, v, [prefill] + [1] * (q.shape[2] - prefill))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gather_max", [0, 1000], ids=["masked", "gathered"])
@pytest.mark.parametrize("pieces", [[44], [5, 20, 3, 16]])
def test_chunked_prefill_equals_reference_rows(monkeypatch, gather_max, pieces):
    monkeypatch.setattr(decode, "GATHER_MAX_QUERIES", gather_max)
    q, k, v = qkv()
    ref = moba_reference(q, k, v, chunk_size=CHUNK, top_k=TOP_K)
    torch.testing.assert_close(run_in_pieces(q, k, v, pieces), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gather_max", [0, 1000], ids=["masked", "gathered"])
def test_left_padding_chunks_start_at_first_real_token(monkeypatch, gather_max):
    monkeypatch.setattr(decode, "GATHER_MAX_QUERIES", gather_max)
    q, k, v = qkv()
    start = torch.tensor([0, 6])
    k[1, :, :6] = 50.0  # padding: would dominate any real query that attended or gated on it
    v[1, :, :6] = 50.0
    ref = moba_reference(q, k, v, chunk_size=CHUNK, top_k=TOP_K, document_ids=padding_ids(start, 44))
    out = run_in_pieces(q, k, v, [10, 10, 1, 1, 22], start=start)
    torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[1, :, 6:], ref[1, :, 6:], rtol=1e-5, atol=1e-5)


def test_dense_decode_equals_full_causal_attention_rows():
    q, k, v = qkv()
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out = run_in_pieces(q, k, v, [20] + [1] * 24, dense_decode=True)
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("top_k", [1, 100])
def test_extreme_top_k(top_k):
    q, k, v = qkv(S=30)
    ref = moba_reference(q, k, v, chunk_size=CHUNK, top_k=top_k)
    cache = MoBAKVCache(CHUNK)
    outs = []
    for t in range(30):
        cache.update(k[:, :, t:t + 1], v[:, :, t:t + 1])
        outs.append(moba_decode_attention(q[:, :, t:t + 1], cache, top_k=top_k))
    torch.testing.assert_close(torch.cat(outs, 2), ref, rtol=1e-5, atol=1e-5)


def test_bad_input_names_the_problem():
    q, k, v = qkv(S=4)
    with pytest.raises(ValueError, match="chunk_size"):
        MoBAKVCache(0)
    with pytest.raises(TypeError, match="chunk_size"):
        ChunkKeySums(1, 1, 4, 2.5)
    cache = MoBAKVCache(CHUNK)
    with pytest.raises(ValueError, match="empty"):
        moba_decode_attention(q, cache, top_k=2)
    cache.update(k[:, :, :2], v[:, :, :2])
    with pytest.raises(ValueError, match="top_k"):
        moba_decode_attention(q[:, :, :1], cache, top_k=0)
    with pytest.raises(ValueError, match="holds only 2 keys"):
        moba_decode_attention(q, cache, top_k=2)
    with pytest.raises(TypeError, match="MoBAKVCache"):
        moba_decode_attention(q, (k, v), top_k=2)
    with pytest.raises(ValueError, match="start"):
        MoBAKVCache(CHUNK, start=torch.tensor([0, 1, 2])).update(k, v)
    with pytest.raises(ValueError, match="chunk sums hold"):
        decode.decode_attention(q[:, :, :1], k, v, cache.sums, top_k=2)


def test_non_contiguous_keys_and_values():
    q, k, v = qkv()
    ref = moba_reference(q, k, v, chunk_size=CHUNK, top_k=TOP_K)
    k_t, v_t = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k, v))  # [B, S, H_kv, D] storage
    sums = ChunkKeySums.from_keys(k_t, CHUNK)
    out = decode.decode_attention(q[:, :, -3:], k_t, v_t, sums, top_k=TOP_K)
    torch.testing.assert_close(out, ref[:, :, -3:], rtol=1e-5, atol=1e-5)
