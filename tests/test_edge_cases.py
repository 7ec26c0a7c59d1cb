"""Edge cases other sparse-attention projects got wrong, each named: ties in gate scores,
top_k far beyond the chunks, lengths off the chunk and block grid, many queries on one
chunk in the backward, one-token documents.

The tie rule (:mod:`flexmoba.gate`): among exactly equal gate scores the
later chunk wins. The brute-force oracle agrees (it sorts ``(score, chunk)`` descending).
Exact ties come from integer-valued queries and keys with power-of-two chunks: every chunk
mean, product and sum is then exact in fp32, so every path sees the same ties.

Decode and chunked prefill with fewer tokens than one chunk and at chunk boundaries are in
``test_decode.py`` (``test_short_sequences_and_chunk_boundaries``); here they meet ties.
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import flex_attention

from flexmoba import (
    MobaSpec,
    compiled_flex_attention,
    dense_moba_mask,
    moba_flex_plan,
    select_chunks,
)
from flexmoba.backends.gather.kernel import BLOCK_UNITS
from flexmoba.decode import moba_decode_attention
from flexmoba.gate import select_against_means, select_local_chunks
from flexmoba.gate.maxima import best_rows
from flexmoba.gate.ties import candidate_rows, chunk_of_row
from flexmoba.kv_cache import ChunkKeySums, MoBAKVCache
from flexmoba.masks import local_moba_mask
from flexmoba.tuning import tuning_for, use_tuning

import oracle
from maxima_paths import MAXIMA_PATHS, maxima_path
from strategies import Problem, divisors, document_ids, random_inputs, run_backend, seeded_randn

BACKENDS = ["sdpa", "gather", "reference"]  # every backend with CPU gradients; "reference": moba_reference
FLEX_BLOCK = 8  # small flex blocks: a sparse table with partial and skipped blocks at these lengths
GRAD_TOL = 2e-5  # fp32 gradients of two exact implementations (see test_attention.grad_tolerance)




def integer_inputs(seed: int, B: int, H: int, H_kv: int, S: int, D: int):
    """q, k in {-1, 0, 1} (ties everywhere, zero keys included), v normal: ``[B, H(_kv), S, D]``."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-1, 2, (B, H, S, D), generator=gen).float()
    k = torch.randint(-1, 2, (B, H_kv, S, D), generator=gen).float()
    return q, k, torch.randn(B, H_kv, S, D, generator=gen)


@st.composite
def tied_problems(draw):
    """Problems whose gate scores tie exactly, with a real choice among past chunks."""
    B, H_kv = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    H, D = H_kv * draw(st.sampled_from([1, 2])), draw(st.sampled_from([2, 4]))
    chunk_size = draw(st.sampled_from([1, 2, 4, 8]))
    S = draw(st.integers(3 * chunk_size, 48))
    top_k = draw(st.integers(2, -(-S // chunk_size) - 1))
    ids = draw(document_ids(B, S, main=top_k * chunk_size + 1))
    # Tiles only when every tile is whole: a partial tile's mean query is not exact in fp32.
    whole_tiles = [g for g in divisors(chunk_size) if S % g == 0] if ids is None else []
    granularity = draw(st.sampled_from(["token", *whole_tiles]))
    q, k, v = integer_inputs(draw(st.integers(0, 2**31 - 1)), B, H, H_kv, S, D)
    return Problem(q, k, v, chunk_size, top_k, granularity, ids)


def oracle_out(problem):
    return oracle.attention(problem.q, problem.k, problem.v, **problem.attention_kwargs)


def eager_flex_plan_out(problem, block_size=FLEX_BLOCK):
    plan = moba_flex_plan(problem.q, problem.k, chunk_size=problem.chunk_size, top_k=problem.top_k,
                          document_ids=problem.document_ids, granularity=problem.granularity,
                          block_size=block_size, sink=True)
    return plan.attention(problem.q, problem.k, problem.v, scale=problem.scale, flex=flex_attention)


# -- ties in gate scores -------------------------------------------------------------------


@pytest.mark.parametrize("n_chunks", [5, 8, 16, 33, 100])  # torch.topk's tie order changes with the length
def test_exact_ties_go_to_the_later_chunk(n_chunks):
    c, top_k = 2, 4
    q = torch.randn(1, 2, n_chunks * c, 4)
    q[:, 1] = -q[:, 1].abs()  # scores against zero means: -0.0 for this head, +0.0 or -0.0 for the other
    k = torch.zeros(1, 1, n_chunks * c, 4)  # every chunk mean is zero: all past scores tie
    selection = select_chunks(q, k, chunk_size=c, top_k=top_k)
    last = n_chunks - 1
    chosen = selection.chunks[0, :, -1].nonzero()[:, 1].view(2, -1)
    assert chosen.tolist() == [list(range(last - top_k + 1, last + 1))] * 2

    past, _ = select_against_means(q[:, :, -1:], ChunkKeySums.from_keys(k, c).means(), torch.tensor([[last]]), top_k)
    assert sorted(past[0, :, 0].flatten().tolist()) == sorted([last - 1, last - 2, last - 3] * 2)


@pytest.mark.parametrize("path", MAXIMA_PATHS)
@given(st.lists(st.floats(allow_nan=False, width=32) | st.sampled_from([0.0, -0.0]), min_size=1, max_size=12))
def test_maxima_order_as_score_then_later_chunk(path, scores):
    """Scores of chunks ``0 .. n-1`` of one query, on every path the gate takes maxima: equal floats tie
    (0.0 and -0.0 included, though their bits differ) and the later chunk wins; -inf is never taken."""
    n = len(scores)
    with maxima_path(path):
        rows = candidate_rows(torch.tensor(scores, dtype=torch.float32)[:, None], 0, n).contiguous()
        best, valid = best_rows(rows, n)
        chunks = chunk_of_row(best, 0, n)
    by_rule = sorted(range(n), key=lambda j: (scores[j], j), reverse=True)
    taken = [j for j in by_rule if scores[j] > float("-inf")]
    assert chunks[:len(taken), 0].tolist() == taken and valid[:, 0].tolist() == [True] * len(taken) + [False] * (
        n - len(taken))


def test_repeated_chunks_tie_and_the_later_copy_wins():
    c = 4
    pattern = torch.tensor([[1.0, 0, 1, -1], [1, 1, 0, 0], [0, 1, 1, 0], [1, 0, 0, -1]])[None, None]
    k = torch.cat([pattern, -pattern, pattern, torch.randn(1, 1, c, 4)], 2)  # chunks 0 and 2 are copies
    q = pattern.mean(2, keepdim=True).expand(1, 1, 4 * c, 4)  # copies score |mean|^2 > 0, chunk 1 below 0
    chunks = select_chunks(q, k, chunk_size=c, top_k=2).chunks[0, 0, -1]
    assert chunks.tolist() == [False, False, True, True]


@pytest.mark.parametrize("backend", BACKENDS)
@given(tied_problems())
def test_tied_gate_scores_every_backend_equals_oracle(backend, problem):
    assert torch.equal(dense_moba_mask(select_chunks(problem.q, problem.k, **problem.kwargs)),
                       oracle.dense_mask(problem.q, problem.k, **problem.kwargs)), problem
    got = run_backend(backend, problem.q, problem.k, problem.v, **problem.attention_kwargs)
    torch.testing.assert_close(got.double(), oracle_out(problem), atol=1e-5, rtol=1e-5)


def decode_in_pieces(q, k, v, chunk, top_k, pieces, backend="auto"):
    cache, outs, t = MoBAKVCache(chunk), [], 0
    for n in pieces:
        cache.update(k[:, :, t:t + n], v[:, :, t:t + n])
        outs.append(moba_decode_attention(q[:, :, t:t + n], cache, top_k=top_k, backend=backend))
        t += n
    return torch.cat(outs, 2)


@pytest.mark.parametrize("path", MAXIMA_PATHS)
def test_tied_gate_scores_decode_equals_oracle_on_every_maxima_path(path):
    """Decoding's gate takes a slot's maximum by ``max`` with indices on few scores, by pooling or
    ``amax`` passes on many (:mod:`maxima_paths`); small problems only reach the first, so each is
    forced here."""
    q, k, v = integer_inputs(7, 2, 4, 2, 44, 4)
    expected = oracle.attention(q, k, v, 8, 3).float()
    with maxima_path(path):
        out = decode_in_pieces(q, k, v, 8, 3, [1] * 44)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spans_read_host", [True, False], ids=["cpu_spans", "every_chunk"])
@pytest.mark.parametrize("path", MAXIMA_PATHS)
@given(tied_problems())
def test_tied_gate_scores_with_documents_equal_oracle_on_every_maxima_path(spans_read_host, path, problem):
    """With documents the gate scores spans of positions against the chunks they may select, latest
    first, a -inf bias off each position's document past, and takes maxima like decoding's gate
    (:mod:`maxima_paths`). Small problems only reach ``max`` with indices, so each path is forced
    here; so are many spans (small problems fill one) and the one span other devices use (bounds
    would take a host read there)."""
    B, S = problem.q.shape[0], problem.q.shape[2]
    ids = problem.document_ids if problem.document_ids is not None else torch.zeros(B, S, dtype=torch.long)
    kwargs = {**problem.kwargs, "document_ids": ids}
    with maxima_path(path, spans_read_host=spans_read_host, span_scores=1):
        mask = dense_moba_mask(select_chunks(problem.q, problem.k, **kwargs))
    assert torch.equal(mask, oracle.dense_mask(problem.q, problem.k, **kwargs)), problem


@pytest.mark.parametrize("path", MAXIMA_PATHS)
@given(tied_problems(), st.data())
def test_tied_gate_scores_under_context_parallelism_equal_oracle(path, problem, data):
    """Context parallelism's gate (a slice of queries against every key) breaks ties as the whole
    sequence's does: the slice's mask is the oracle's rows, at a drawn boundary."""
    S = problem.q.shape[2]
    start = data.draw(st.integers(1, S - 1), label="query_start")
    spec = MobaSpec(problem.chunk_size, problem.top_k)
    expected = oracle.dense_mask(problem.q, problem.k, problem.chunk_size, problem.top_k,
                                 document_ids=problem.document_ids)
    with maxima_path(path, span_scores=1):
        selection = select_local_chunks(problem.q[:, :, start:], problem.k, spec, start, problem.document_ids)
    assert torch.equal(local_moba_mask(selection, start, S), expected[:, :, start:]), problem


@pytest.mark.parametrize("path", ["pooled", "amax_passes"])
@given(tied_problems())
def test_tied_gate_scores_on_the_grid_equal_oracle_on_both_maxima_paths(path, problem):
    """Without documents the gate ranks groups of whole query chunks, pooled on CPU and by ``amax``
    passes elsewhere; each is forced here, in one group and in one group per query chunk."""
    kwargs = {**problem.kwargs, "document_ids": None}
    expected = oracle.dense_mask(problem.q, problem.k, **kwargs)
    for group_scores in (tuning_for("cpu").group_scores, 1):
        with maxima_path(path, group_scores=group_scores):
            mask = dense_moba_mask(select_chunks(problem.q, problem.k, **kwargs))
        assert torch.equal(mask, expected), (group_scores, problem)


@given(tied_problems())
def test_tied_gate_scores_flex_plan_equals_oracle(problem):
    torch.testing.assert_close(eager_flex_plan_out(problem).double(), oracle_out(problem), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["auto", "gather", "sdpa"])
@pytest.mark.parametrize("pieces", [[1] * 44, [8, 8, 8, 8, 8, 4], [5, 3, 16, 1, 7, 12]],
                         ids=["tokens", "chunk_boundaries", "mixed"])
def test_tied_gate_scores_decode_equals_oracle(backend, pieces):
    q, k, v = integer_inputs(7, 2, 4, 2, 44, 4)
    expected = oracle.attention(q, k, v, 8, 3).float()
    torch.testing.assert_close(decode_in_pieces(q, k, v, 8, 3, pieces, backend), expected, atol=1e-5, rtol=1e-5)


# -- top_k far beyond the number of chunks -------------------------------------------------


@pytest.mark.parametrize("backend", [*BACKENDS, "flex_plan", "decode"])
def test_top_k_far_beyond_the_chunks_is_causal_attention(backend):
    q, k, v = random_inputs(0, 2, 4, 2, 45, 8)
    top_k = 10**6
    if backend == "flex_plan":
        got = eager_flex_plan_out(Problem(q, k, v, 4, top_k, "token", None))
    elif backend == "decode":
        cache = MoBAKVCache(4)
        cache.update(k[:, :, :20], v[:, :, :20])
        first = moba_decode_attention(q[:, :, :20], cache, top_k=top_k, backend="sdpa")
        cache.update(k[:, :, 20:], v[:, :, 20:])
        got = torch.cat([first, moba_decode_attention(q[:, :, 20:], cache, top_k=top_k, backend="gather")], 2)
    else:
        got = run_backend(backend, q, k, v, chunk_size=4, top_k=top_k)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# -- lengths off the chunk and block grid ----------------------------------------------------


@pytest.mark.parametrize("backend", [*BACKENDS, "flex_plan"])
@pytest.mark.parametrize("S", [1, 7, 45, 83])  # chunk 8, flex block 8 or 16: never a multiple of either
def test_length_not_a_multiple_of_chunk_or_block(backend, S):
    q, k, v = random_inputs(S, 1, 4, 2, S, 8)
    problem = Problem(q, k, v, 8, 3, "token", None)
    if backend == "flex_plan":
        got = eager_flex_plan_out(problem, block_size=(8, 16))
    else:
        got = run_backend(backend, q, k, v, **problem.attention_kwargs)
    torch.testing.assert_close(got.double(), oracle_out(problem), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_length_not_a_multiple_of_chunk_or_block_compiled_flex():
    """Compiled flex reads the block tables (eager flex reads only the mask_mod)."""
    q, k, v = random_inputs(1, 1, 4, 2, 83, 8)
    problem = Problem(q, k, v, 8, 3, "token", None)
    plan = moba_flex_plan(q, k, chunk_size=8, top_k=3, block_size=16, sink=True)
    got = plan.attention(q, k, v, flex=compiled_flex_attention())
    torch.testing.assert_close(got.double(), oracle_out(problem), atol=1e-5, rtol=1e-5)


# -- many queries selecting the same chunk, in the backward ------------------------------------


def popular_chunk_inputs(S=640, c=8):
    """Inputs where every query past chunk 0 selects chunk 0 (its keys share a direction with
    every query): ``S - c`` queries, several of gather's query blocks, read one chunk."""
    q, k, v = random_inputs(5, 1, 2, 1, S, 8)
    q = q * 0.3
    q[..., 0] = 1.0
    k[:, :, :c, 0] += 10.0
    return q, k, v


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_many_queries_selecting_the_same_chunk_have_reference_gradients(fused):
    q, k, v = popular_chunk_inputs()
    kw = dict(chunk_size=8, top_k=2)
    chunks = select_chunks(q, k, **kw).chunks
    assert chunks[:, :, 8:, 0].all(), "chunk 0 is everyone's pick"
    fills_several_sizes = (q.shape[2] - 8) * q.shape[1] > BLOCK_UNITS[0] * tuning_for(q.device).gather_query_block
    assert fills_several_sizes, "chunk 0's pairs fill several block sizes"
    grad_out = seeded_randn(q)

    def grads(backend):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        with use_tuning("cpu", gather_fused_kernel=fused):
            (run_backend(backend, *inputs, **kw) * grad_out).sum().backward()
        return [t.grad for t in inputs]

    for got, want, name in zip(grads("gather"), grads("reference"), "qkv", strict=True):
        torch.testing.assert_close(got, want, atol=GRAD_TOL, rtol=1e-5, msg=f"d{name}")


# -- documents of length 1 --------------------------------------------------------------------


@pytest.mark.parametrize("backend", [*BACKENDS, "flex_plan"])
def test_one_token_documents_attend_only_themselves(backend):
    q, k, v = random_inputs(2, 2, 4, 2, 24, 8)
    ids = (torch.arange(24) % 2).expand(2, 24)  # 0, 1, 0, 1, ...: every document is one token
    problem = Problem(q, k, v, 4, 2, "token", ids)
    if backend == "flex_plan":
        got = eager_flex_plan_out(problem)
    else:
        got = run_backend(backend, q, k, v, **problem.attention_kwargs)
    torch.testing.assert_close(got, v.repeat_interleave(2, 1), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", ["sdpa", "gather"])
def test_one_token_documents_have_reference_gradients(backend):
    q, k, v = random_inputs(3, 1, 2, 1, 30, 8)
    ids = torch.tensor([[0] + [1] * 12 + [2] + [3] * 15 + [4]])  # one-token documents at start, middle, end
    problem = Problem(q, k, v, 4, 2, "token", ids)
    grad_out = seeded_randn(q)

    def grads(name):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        (run_backend(name, *inputs, **problem.attention_kwargs) * grad_out).sum().backward()
        return [t.grad for t in inputs]

    for got, want in zip(grads(backend), grads("reference"), strict=True):
        torch.testing.assert_close(got, want, atol=GRAD_TOL, rtol=1e-5)
