"""MoBA decoding with a KV cache equals MoBA over the whole sequence, row by row, on every
decode kernel, reached through the one backend table; the gate entry against chunk means."""

import pytest
import torch
import torch.nn.functional as F

from flexmoba import MobaSpec, moba_decode_attention, moba_reference, register_backend
from flexmoba.backends import get_backend, get_decode_backend
from flexmoba.decode import attend_cached_keys
from flexmoba.gate import select_against_means
from flexmoba.kv_cache import ChunkKeySums, MoBAKVCache

import oracle

CHUNK, TOP_K = 8, 3
CUT = CHUNK * TOP_K  # up to this many cached positions, MoBA decode is dense attention
# "auto"; "gather" on an fp32 MoBAKVCache (the embedding_bag kernel over its key blocks);
# "gather-copy": "gather" over a chunk state that keeps no blocks (the gathered copy, as the
# transformers adapter decodes with chunk_means="recompute"); "sdpa" (one mask).
GATHER_COPY = "gather-copy"
KERNELS = ["auto", "gather", GATHER_COPY, "sdpa"]


def qkv(B=2, H=4, H_kv=2, S=44, D=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, D, generator=g)
    k = torch.randn(B, H_kv, S, D, generator=g)
    v = torch.randn(B, H_kv, S, D, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def padding_ids(start, S):
    """document_ids putting each row's left padding in its own document."""
    return (torch.arange(S)[None, :] >= start[:, None]).long()


def run_in_pieces(q, k, v, pieces, start=None, top_k=TOP_K, kernel="auto", grad_last_only=False, **kwargs):
    """Feed the sequence to a MoBAKVCache piece by piece; attend each piece's queries with ``kernel``.
    ``grad_last_only``: the earlier pieces attend detached queries (the cache is written in place, so
    only its last call can be differentiated)."""
    cache = MoBAKVCache(CHUNK, start=start)
    no_blocks = ChunkKeySums(q.shape[0], k.shape[1], k.shape[3], CHUNK, start=start, key_dtype=k.dtype,
                             keep_blocks=False)
    outs, t = [], 0
    for n in pieces:
        cache.update(k[:, :, t:t + n], v[:, :, t:t + n])
        q_piece = q[:, :, t:t + n]
        if grad_last_only and t + n < q.shape[2]:
            q_piece = q_piece.detach()
        if kernel == GATHER_COPY:
            spec = MobaSpec(CHUNK, top_k, backend="gather")
            outs.append(attend_cached_keys(q_piece, cache.keys, cache.values, no_blocks, spec, **kwargs))
        else:
            outs.append(moba_decode_attention(q_piece, cache, top_k=top_k, backend=kernel, **kwargs))
        t += n
    assert t == q.shape[2]
    if kernel == GATHER_COPY:
        assert no_blocks.blocks is None  # the gathered copy ran, never the blocks kernel
    if kernel == "gather":
        assert cache.chunk_state.blocks is not None  # the blocks kernel ran
    return torch.cat(outs, dim=2)


def oracle_rows(q, k, v, top_k=TOP_K, scale=None, document_ids=None):
    return oracle.attention(q, k, v, CHUNK, top_k, scale=scale, document_ids=document_ids).float()


def test_moba_is_active_at_these_sizes():
    # Otherwise every comparison below could pass with plain causal attention.
    q, k, v = qkv()
    ref = moba_reference(q, k, v, chunk_size=CHUNK, top_k=TOP_K)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert (ref - full)[:, :, CUT:].abs().amax(dim=(0, 1, 3)).min() > 1e-3  # every row past the cut


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


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("H_kv", [2, 4], ids=["gqa", "mha"])
def test_token_by_token_decode_equals_reference_rows(H_kv, kernel):
    q, k, v = qkv(H_kv=H_kv)
    ref = moba_reference(q, k, v, chunk_size=CHUNK, top_k=TOP_K)
    prefill = 13
    out = run_in_pieces(q, k, v, [prefill] + [1] * (q.shape[2] - prefill), kernel=kernel)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("pieces", [[44], [5, 20, 3, 16]])
def test_chunked_prefill_equals_reference_rows(kernel, pieces):
    q, k, v = qkv()
    ref = moba_reference(q, k, v, chunk_size=CHUNK, top_k=TOP_K)
    torch.testing.assert_close(run_in_pieces(q, k, v, pieces, kernel=kernel), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("pieces", [[43, 1], [39, 5]], ids=["one-query", "chunked"])
def test_query_gradients_through_decode_equal_the_reference(kernel, pieces):
    """A decode call is differentiable in its queries (a loss on decoded positions): the last
    piece's dq equals the reference's dq of those rows."""
    q, k, v = qkv()
    n = pieces[-1]
    q.requires_grad_()
    out = run_in_pieces(q, k, v, pieces, kernel=kernel, grad_last_only=True)[:, :, -n:]
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (dq,) = torch.autograd.grad((out * grad_out).sum(), q)
    q_ref = q.detach().clone().requires_grad_()
    ref = moba_reference(q_ref, k, v, chunk_size=CHUNK, top_k=TOP_K)[:, :, -n:]
    (dq_ref,) = torch.autograd.grad((ref * grad_out).sum(), q_ref)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dq, dq_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
def test_decode_rows_equal_the_brute_force_oracle_with_gqa(kernel):
    # The oracle shares no code with flexmoba (tests/oracle.py): gate, chunks and softmax
    # are rebuilt from the paper's description, in float64.
    q, k, v = qkv(H=6, H_kv=2, S=41)
    out = run_in_pieces(q, k, v, [9, 1, 1, 16, 1, 1, 1, 11], kernel=kernel)
    torch.testing.assert_close(out, oracle_rows(q, k, v), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("S, pieces", [
    (5, [5]), (5, [1] * 5), (5, [2, 3]),  # fewer tokens than one chunk
    (8, [8]), (8, [7, 1]),  # exactly one chunk
    (33, [8, 8, 8, 8, 1]), (33, [16, 1] + [1] * 16), (33, [32, 1]), (33, [1] * 33),  # at chunk boundaries
])
def test_short_sequences_and_chunk_boundaries(kernel, S, pieces):
    q, k, v = qkv(S=S, seed=S)
    out = run_in_pieces(q, k, v, pieces, top_k=2, kernel=kernel)
    torch.testing.assert_close(out, oracle_rows(q, k, v, top_k=2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
def test_custom_scale_against_the_oracle(kernel):
    # Pieces of 1 and 16 and a prefill above the cut reach every kernel under "auto".
    q, k, v = qkv()
    expected = oracle_rows(q, k, v, scale=0.9)
    out = run_in_pieces(q, k, v, [3, 1, 1, 20, 1, 18], kernel=kernel, scale=0.9)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert (out - oracle_rows(q, k, v)).abs().max() > 1e-2  # the scale matters here


def test_custom_scale_with_dense_decode():
    q, k, v = qkv()
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.9)
    out = run_in_pieces(q, k, v, [20] + [1] * 24, dense_decode=True, scale=0.9)
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
def test_left_padding_chunks_start_at_first_real_token(kernel):
    q, k, v = qkv()
    start = torch.tensor([0, 6])
    k[1, :, :6] = 50.0  # padding: would dominate any real query that attended or gated on it
    v[1, :, :6] = 50.0
    ref = moba_reference(q, k, v, chunk_size=CHUNK, top_k=TOP_K, document_ids=padding_ids(start, 44))
    out = run_in_pieces(q, k, v, [10, 10, 1, 1, 22], start=start, kernel=kernel)
    torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[1, :, 6:], ref[1, :, 6:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pieces", [[44], [26, 18], [1] * 44, [30] + [1] * 14],
                         ids=["prefill", "chunked", "tokens", "mixed"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_non_finite_padding_never_reaches_a_real_row(kernel, pieces):
    # Big pieces take the one-mask kernel, single tokens the gathered ones, short contexts the
    # dense shortcut; padding keys and values hold NaN and inf.
    q, k, v = qkv()
    start = torch.tensor([0, 6])
    clean = moba_reference(q, k, v, chunk_size=CHUNK, top_k=TOP_K, document_ids=padding_ids(start, 44))
    k[1, :, :6], v[1, :, :3], v[1, :, 3:6] = float("nan"), float("inf"), float("nan")
    out = run_in_pieces(q, k, v, pieces, start=start, kernel=kernel)
    assert torch.isfinite(out[1, :, 6:]).all()
    torch.testing.assert_close(out[1, :, 6:], clean[1, :, 6:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[0], clean[0], rtol=1e-5, atol=1e-5)


def official_gate_reference(q, k, v, chunk, top_k):
    """MoBA in fp32 whose gate pools each chunk's keys and rounds the mean to the key dtype
    before scoring, as the official implementation does. No documents, no padding."""
    B, H, S, D = q.shape
    group, n = H // k.shape[1], -(-S // chunk)
    counts = torch.tensor([min(chunk, S - j * chunk) for j in range(n)], dtype=torch.float32)
    sums = F.pad(k.float(), (0, 0, 0, n * chunk - S)).view(B, -1, n, chunk, D).sum(3)
    means = (sums / counts[:, None]).to(k.dtype).float().repeat_interleave(group, 1)  # [B, H, n, D]
    own = torch.arange(S) // chunk
    past = torch.arange(n)[None, :] < own[:, None]  # [S, n]
    scores = (q.float() @ means.transpose(-1, -2)).masked_fill(~past, float("-inf"))
    best = scores.topk(min(top_k - 1, n), dim=-1).indices
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, best, True) & past
    chosen |= torch.arange(n)[None, :] == own[:, None]
    mask = chosen.repeat_interleave(chunk, -1)[..., :S] & (torch.arange(S)[None, :] <= torch.arange(S)[:, None])
    k32, v32 = (x.float().repeat_interleave(group, 1) for x in (k, v))
    probs = (q.float() @ k32.transpose(-1, -2) * D ** -0.5).masked_fill(~mask, float("-inf")).softmax(-1)
    return probs @ v32


@pytest.mark.parametrize("backend", ["gather", "sdpa"])  # in bf16/fp16 gather reads a gathered copy
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_decode_gates_on_means_rounded_to_the_key_dtype(dtype, backend):
    # 32K decode rows: about 0.3% of them (bf16) pick another chunk if the means are not
    # rounded like the official gate's, and then miss by far more than the tolerance.
    q, k, v = qkv(B=4, H=8, H_kv=2, S=1024, D=32, dtype=dtype)
    ref = official_gate_reference(q, k, v, chunk=16, top_k=3)
    cache, outs = MoBAKVCache(16), []
    for t in range(0, 1024, 16):
        cache.update(k[:, :, t:t + 16], v[:, :, t:t + 16])
        outs.append(moba_decode_attention(q[:, :, t:t + 16], cache, top_k=3, backend=backend))
    out = torch.cat(outs, dim=2)
    assert out.dtype == dtype
    assert cache.chunk_state.blocks is None  # no blocks kernel in low precision
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=3e-2)


@pytest.fixture
def gather_decode_calls():
    """Cache lengths of every decode call the table hands to gather (its kernel still runs)."""
    attend, kernel, calls = get_backend("gather"), get_decode_backend("gather"), []

    def recording(step):
        calls.append(step.keys.shape[2])
        return kernel(step)

    register_backend("gather", attend, decode=recording, replace=True)
    yield calls
    register_backend("gather", attend, decode=kernel, replace=True)


def test_auto_is_dense_below_chunk_size_times_top_k(gather_decode_calls):
    # Up to CUT cached positions every query can select all its past chunks: auto decodes
    # densely (and the chunk state is not even built); past the cut it gates, through the table.
    q, k, v = qkv()
    start = torch.tensor([0, 3])
    ref = moba_reference(q, k, v, chunk_size=CHUNK, top_k=TOP_K, document_ids=padding_ids(start, 44))
    cache = MoBAKVCache(CHUNK, start=start)
    for t in range(44):
        cache.update(k[:, :, t:t + 1], v[:, :, t:t + 1])
        out = moba_decode_attention(q[:, :, t:t + 1], cache, top_k=TOP_K)
        torch.testing.assert_close(out[0, :, 0], ref[0, :, t], rtol=1e-5, atol=1e-5)
        if t == CUT - 1:
            assert cache.chunk_state.length == 0
    assert gather_decode_calls == list(range(CUT + 1, 45))  # row 0 (no padding) outgrows the cut first


def test_a_named_backend_gates_even_where_auto_is_dense(gather_decode_calls):
    q, k, v = qkv(S=CUT)
    out = run_in_pieces(q, k, v, [CUT - 2, 1, 1], kernel="gather")
    torch.testing.assert_close(out, oracle_rows(q, k, v), rtol=1e-5, atol=1e-5)
    assert gather_decode_calls == [CUT - 2, CUT - 1, CUT]


def test_dense_decode_equals_full_causal_attention_rows():
    q, k, v = qkv()
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out = run_in_pieces(q, k, v, [20] + [1] * 24, dense_decode=True)
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("top_k", [1, 100])
def test_extreme_top_k(top_k, kernel):
    q, k, v = qkv(S=30)
    ref = moba_reference(q, k, v, chunk_size=CHUNK, top_k=top_k)
    torch.testing.assert_close(run_in_pieces(q, k, v, [1] * 30, top_k=top_k, kernel=kernel), ref, rtol=1e-5, atol=1e-5)


def test_spec_and_keywords_give_the_same_rows():
    q, k, v = qkv()
    spec = MobaSpec(CHUNK, TOP_K, backend="sdpa")
    cache = MoBAKVCache(CHUNK)
    cache.update(k, v)
    by_spec = moba_decode_attention(q[:, :, -3:], cache, spec, scale=0.7)
    by_keywords = moba_decode_attention(q[:, :, -3:], cache, top_k=TOP_K, backend="sdpa", scale=0.7)
    torch.testing.assert_close(by_spec, by_keywords, rtol=0, atol=0)
    torch.testing.assert_close(by_spec, oracle_rows(q, k, v, scale=0.7)[:, :, -3:], rtol=1e-5, atol=1e-5)


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
    with pytest.raises(TypeError, match="missing MoBA setting.*top_k"):
        moba_decode_attention(q[:, :, :1], cache)
    with pytest.raises(ValueError, match="spec or as keywords, not both"):
        moba_decode_attention(q[:, :, :1], cache, MobaSpec(CHUNK, 2), top_k=2)
    with pytest.raises(ValueError, match="backend must be one of"):
        moba_decode_attention(q[:, :, :1], cache, top_k=2, backend="blocks")
    with pytest.raises(ValueError, match="granularity=4 has no decode path"):
        moba_decode_attention(q[:, :, :1], cache, MobaSpec(CHUNK, 2, granularity=4))
    with pytest.raises(TypeError, match="scale"):
        moba_decode_attention(q[:, :, :1], cache, top_k=2, scale="0.5")
    with pytest.raises(TypeError, match="dense_decode"):
        moba_decode_attention(q[:, :, :1], cache, top_k=2, dense_decode=1)
    with pytest.raises(ValueError, match="holds only 2 keys"):
        moba_decode_attention(q, cache, top_k=2)
    with pytest.raises(TypeError, match="MoBAKVCache"):
        moba_decode_attention(q, (k, v), top_k=2)
    with pytest.raises(ValueError, match="start"):
        MoBAKVCache(CHUNK, start=torch.tensor([0, 1, 2])).update(k, v)
    ahead = ChunkKeySums.from_keys(k, CHUNK)  # 4 keys, used with 2
    with pytest.raises(ValueError, match="chunk sums hold 4 keys but keys hold only 2"):
        attend_cached_keys(q[:, :, :1], k[:, :, :2], v[:, :, :2], ahead, MobaSpec(CHUNK, 2))


def test_a_spec_with_another_chunk_size_than_the_cache_is_refused():
    q, k, v = qkv(S=4)
    cache = MoBAKVCache(CHUNK)
    cache.update(k, v)
    with pytest.raises(ValueError, match=rf"spec.chunk_size=4 differs from the cache's chunk_size={CHUNK}"):
        moba_decode_attention(q[:, :, -1:], cache, MobaSpec(4, 2))
    with pytest.raises(ValueError, match=rf"spec.chunk_size=4 differs from the chunk sums' chunk_size={CHUNK}"):
        attend_cached_keys(q[:, :, -1:], k, v, ChunkKeySums.from_keys(k, CHUNK), MobaSpec(4, 2))


@pytest.mark.parametrize("backend", ["flex", "flex_union"])
def test_flex_does_not_decode_and_is_refused_by_name(backend):
    q, k, v = qkv(S=CUT)  # short enough that auto would decode densely: a named backend is never replaced
    cache = MoBAKVCache(CHUNK)
    cache.update(k, v)
    with pytest.raises(ValueError, match=rf"^backend '{backend}' does not decode; decode with backend='auto'"):
        moba_decode_attention(q[:, :, -1:], cache, top_k=TOP_K, backend=backend)


@pytest.mark.parametrize("storage", [(0, 2, 1, 3), (0, 1, 3, 2)], ids=["BSHD", "BHDS"])
@pytest.mark.parametrize("backend, keep_blocks", [("auto", True), ("gather", True), ("gather", False),
                                                  ("sdpa", True)])
def test_non_contiguous_keys_and_values(backend, keep_blocks, storage):
    # Keys and values in the memory orders a transformers cache may hand the adapter.
    q, k, v = qkv()
    ref = moba_reference(q, k, v, chunk_size=CHUNK, top_k=TOP_K)
    k_t, v_t = (x.permute(storage).contiguous().permute(storage) for x in (k, v))  # other memory orders
    sums = ChunkKeySums.from_keys(k_t, CHUNK, keep_blocks=keep_blocks)
    out = attend_cached_keys(q[:, :, -3:], k_t, v_t, sums, MobaSpec(CHUNK, TOP_K, backend=backend))
    torch.testing.assert_close(out, ref[:, :, -3:], rtol=1e-5, atol=1e-5)
    assert (sums.blocks is not None) == (keep_blocks and backend != "sdpa")  # which gather kernel ran


# -- the gate against precomputed chunk means ------------------------------------------------


def oracle_chosen_chunks(q, k, top_k, rows):
    """Per (b, h, row): the sorted chunk indices the oracle attends (own chunk included)."""
    chosen = oracle.selected_chunks(q, k, CHUNK, top_k)
    return {(b, h, t): sorted(s // CHUNK for s, _ in chosen[b, h, t]) for (b, h, t) in chosen if t in rows}


@pytest.mark.parametrize("zero_keys", [False, True], ids=["random", "all_tied"])
@pytest.mark.parametrize("top_k", [1, 3, 9])
def test_gate_against_means_equals_the_oracle(top_k, zero_keys):
    # All-zero keys tie every score: the later chunks must win, as in select_chunks.
    q, k, _ = qkv(H=6, H_kv=2, S=45)
    if zero_keys:
        k = torch.zeros_like(k)
    rows = list(range(30, 45))
    own = torch.tensor(rows)[None, :].expand(2, -1) // CHUNK
    past, valid = select_against_means(q[:, :, 30:], ChunkKeySums.from_keys(k, CHUNK).means(), own, top_k)
    expected = oracle_chosen_chunks(q, k, top_k, rows)
    for (b, h, t), chunks in expected.items():
        i = t - 30
        got = sorted(past[b, h, i][valid[b, h, i]].tolist() + [int(own[b, i])])
        assert got == chunks, (b, h, t)


def test_gate_against_means_names_bad_input():
    q = torch.randn(2, 4, 3, 8)
    means, own = torch.randn(2, 2, 5, 8), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="means must be"):
        select_against_means(q, means[..., :4], own, 2)
    with pytest.raises(ValueError, match="means must be"):
        select_against_means(q, torch.randn(2, 3, 5, 8), own, 2)
    with pytest.raises(TypeError, match="means must be float32"):
        select_against_means(q, means.double(), own, 2)
    with pytest.raises(TypeError, match="own must be an integer"):
        select_against_means(q, means, own.float(), 2)
    with pytest.raises(ValueError, match="own must be"):
        select_against_means(q, means, own[:, :2], 2)
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        select_against_means(q, means, own, 0)
