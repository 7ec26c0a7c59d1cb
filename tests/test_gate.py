"""The gate: which chunks each query attends, against the brute-force oracle."""

import pytest
import torch
from hypothesis import given, settings

from flexmoba import dense_moba_mask, moba_selection, select_chunks
from flexmoba.gate.selection import position_spans, query_chunk_groups
from flexmoba.tuning import use_tuning

import oracle
from maxima_paths import maxima_path
from strategies import EXAMPLES, describe, more_examples, problems, with_examples


def document_index(problem):
    """[B, S] index of each position's document (its run of equal ids, via the oracle)."""
    B, _, S, _ = problem.q.shape
    out = torch.zeros(B, S, dtype=torch.long)
    for b in range(B):
        ids = None if problem.document_ids is None else problem.document_ids[b]
        for i, (start, end) in enumerate(oracle.documents(ids, S)):
            out[b, start:end] = i
    return out


def causal_same_document(problem):
    B, _, S, _ = problem.q.shape
    pos = torch.arange(S)
    causal = pos[None, :] <= pos[:, None]
    doc = document_index(problem)
    return (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]


def local_chunk_of(problem):
    """[B, S] index of each position's chunk inside its document (via the oracle's runs)."""
    B, _, S, _ = problem.q.shape
    out = torch.zeros(B, S, dtype=torch.long)
    for b in range(B):
        ids = None if problem.document_ids is None else problem.document_ids[b]
        for start, end in oracle.documents(ids, S):
            out[b, start:end] = torch.arange(end - start) // problem.chunk_size
    return out


@more_examples()
@with_examples()
@given(problems())
def test_selection_equals_oracle(problem):
    got = dense_moba_mask(select_chunks(problem.q, problem.k, **problem.kwargs))
    expected = oracle.dense_mask(problem.q, problem.k, **problem.kwargs)
    assert torch.equal(got, expected), problem


@more_examples()
@with_examples()
@given(problems())
def test_selection_in_one_group_per_query_chunk_equals_oracle(problem):
    """Small problems score all query chunks as one group; this scores each apart (up to 16 groups, or
    spans of positions with documents)."""
    with use_tuning("cpu", group_scores=1, span_scores=1):
        got = dense_moba_mask(select_chunks(problem.q, problem.k, **problem.kwargs))
    assert torch.equal(got, oracle.dense_mask(problem.q, problem.k, **problem.kwargs)), problem


@pytest.mark.parametrize("profile", ["cpu", "cuda"])
@with_examples()
@given(problems())
def test_selection_within_a_one_score_buffer_equals_oracle(profile, problem):
    """The memory bound at its extreme: one query chunk per group, one position per span (with the
    bounds read from the host on CPU, spans of every chunk without)."""
    with use_tuning(profile, gate_buffer_scores=1):
        got = dense_moba_mask(select_chunks(problem.q, problem.k, **problem.kwargs))
    assert torch.equal(got, oracle.dense_mask(problem.q, problem.k, **problem.kwargs)), problem


@pytest.mark.parametrize("path", ["pooled", "amax_passes"])
@with_examples()
@given(problems())
def test_selection_on_many_scores_equals_oracle_on_both_maxima_paths(path, problem):
    """Small problems rank few scores (``max`` with indices) except on the grid, which CPU pools: each
    path for many scores, the CPU's and other devices', forced on every problem."""
    with maxima_path(path):
        got = dense_moba_mask(select_chunks(problem.q, problem.k, **problem.kwargs))
    assert torch.equal(got, oracle.dense_mask(problem.q, problem.k, **problem.kwargs)), problem


@more_examples()
@with_examples()
@given(problems())
def test_each_query_selects_own_chunk_plus_top_k_minus_one_past(problem):
    chunks = moba_selection(problem.q, problem.k, **problem.kwargs)
    own = local_chunk_of(problem)[:, None, :]  # [B, 1, S]
    expected = torch.clamp(own, max=problem.top_k - 1) + 1
    assert torch.equal(chunks.sum(-1), expected.expand_as(chunks[..., 0]))
    assert chunks.gather(-1, own[..., None].expand(*chunks.shape[:3], 1)).all(), "own chunk always attended"
    future = torch.arange(chunks.shape[-1]) > own[..., None]
    assert not (chunks & future).any(), "a future chunk was selected"


@more_examples()
@with_examples()
@given(problems())
def test_short_sequences_are_full_causal(problem):
    S = problem.q.shape[2]
    problem = problem.but(top_k=max(problem.top_k, -(-S // problem.chunk_size)))  # chunk_size * top_k >= S
    mask = dense_moba_mask(select_chunks(problem.q, problem.k, **problem.kwargs))
    assert torch.equal(mask, causal_same_document(problem).expand_as(mask))


@more_examples()
@with_examples()
@given(problems())
def test_top_k_one_is_block_diagonal_causal(problem):
    problem = problem.but(top_k=1)
    mask = dense_moba_mask(select_chunks(problem.q, problem.k, **problem.kwargs))
    chunk = local_chunk_of(problem)
    same_chunk = chunk[:, :, None] == chunk[:, None, :]
    expected = causal_same_document(problem) & same_chunk[:, None]
    assert torch.equal(mask, expected.expand_as(mask))


@more_examples()
@with_examples()
@given(problems())
def test_tile_granularity_shares_one_selection_per_tile(problem):
    if problem.granularity == "token":
        problem = problem.but(granularity=problem.chunk_size)
    g = problem.granularity
    chunks = moba_selection(problem.q, problem.k, **problem.kwargs)
    B, _, S, _ = problem.q.shape
    for b in range(B):
        ids = None if problem.document_ids is None else problem.document_ids[b]
        for start, end in oracle.documents(ids, S):
            for tile_start in range(start, end, g):
                tile = chunks[b, :, tile_start:min(tile_start + g, end)]
                assert (tile == tile[:, :1]).all(), (problem, tile_start)


@more_examples()
@with_examples()
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


# -- the strategies really put the gate to a choice ---------------------------------------


def test_strategies_put_the_gate_to_a_choice():
    """Most drawn problems make some query choose; GQA, tiles and reused ids choose too."""
    seen = []

    @settings(max_examples=200, derandomize=True, database=None)
    @given(problems())
    def draw(problem):
        seen.append(describe(problem))

    draw()
    n = len(seen)

    def share(predicate):
        return sum(map(predicate, seen)) / n

    assert share(lambda f: f.chooses) >= 0.6
    assert share(lambda f: f.chooses and f.gqa) >= 0.15
    assert share(lambda f: f.chooses and f.tiles) >= 0.15
    assert share(lambda f: f.chooses and f.reused_ids) >= 0.15
    assert share(lambda f: f.one_token_document) >= 0.1
    assert share(lambda f: f.n_documents >= 3) >= 0.3
    for name, problem in EXAMPLES.items():
        assert describe(problem).chooses, name
    assert describe(EXAMPLES["gqa_choice"]).gqa and describe(EXAMPLES["tiles_choice"]).tiles
    assert describe(EXAMPLES["reused_ids"]).reused_ids and describe(EXAMPLES["one_token_documents"]).one_token_document
    assert all(vars(describe(EXAMPLES["all_at_once"])).values())


@more_examples()
@with_examples("tiles_choice", "all_at_once")
@given(problems(tiles=True))
def test_tile_granularity_equals_oracle(problem):
    got = dense_moba_mask(select_chunks(problem.q, problem.k, **problem.kwargs))
    assert torch.equal(got, oracle.dense_mask(problem.q, problem.k, **problem.kwargs)), problem


# -- documents are runs of equal ids -------------------------------------------------------


def test_a_reused_id_starts_a_new_document():
    ids = torch.tensor([[7, 7, 3, 3, 7]])
    q, k = torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4)
    mask = dense_moba_mask(select_chunks(q, k, chunk_size=1, top_k=5, document_ids=ids))[0, 0]
    expected = torch.tensor([[1, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0],
                             [0, 0, 1, 0, 0],
                             [0, 0, 1, 1, 0],
                             [0, 0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(mask, expected)
    chunks = moba_selection(q, k, chunk_size=1, top_k=5, document_ids=ids)[0, 0]
    assert chunks.nonzero().tolist() == [[0, 0], [1, 0], [1, 1], [2, 0], [3, 0], [3, 1], [4, 0]]


@more_examples()
@with_examples("reused_ids", "one_token_documents", "all_at_once")
@given(problems())
def test_only_runs_matter_not_the_labels(problem):
    """Relabelling every run with its own fresh id changes nothing."""
    if problem.document_ids is None:
        return
    ids = problem.document_ids
    fresh = torch.cumsum(torch.cat([torch.ones_like(ids[:, :1]), (ids[:, 1:] != ids[:, :-1]).long()], 1), 1) * 10
    relabelled = dict(problem.kwargs, document_ids=fresh)
    assert torch.equal(moba_selection(problem.q, problem.k, **problem.kwargs),
                       moba_selection(problem.q, problem.k, **relabelled))


# -- low precision: chunk means rounded through the key dtype, as the official gate does ---


@pytest.mark.parametrize("lead", [0, 3], ids=["one_document", "after_a_document"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_gate_rounds_chunk_means_through_the_key_dtype(dtype, lead):
    """Two past chunks whose order flips when their means are rounded to k's dtype.

    With ``eps`` the dtype's spacing at 1 and the query ``(1, 0.875)``: chunk A's exact mean
    ``(1 + 0.6 eps, 1)`` rounds to ``(1 + eps, 1)``, chunk B's ``(1, 1 + 0.8 eps)`` to
    ``(1, 1 + eps)``. Exact scores put B first (0.7 eps > 0.6 eps), rounded ones A (eps > 0.875 eps).
    The official gate rounds, so the query must pick A. ``lead``: tokens of an earlier
    document before the three chunks (chunk means are then pooled per document).
    """
    eps, c = torch.finfo(dtype).eps, 5
    S = lead + 3 * c
    k = torch.randn(1, 1, S, 4)  # the leading document and the own chunk: never scored
    k[0, 0, lead:lead + 2 * c] = 0.0
    k[0, 0, lead:lead + 2 * c, :2] = 1.0
    k[0, 0, lead:lead + 3, 0] += eps  # chunk A: 3 of 5 keys nudged in dim 0
    k[0, 0, lead + c:lead + c + 4, 1] += eps  # chunk B: 4 of 5 keys nudged in dim 1
    q = torch.zeros(1, 1, S, 4)
    q[..., 0], q[..., 1] = 1.0, 0.875
    q, k = q.to(dtype), k.to(dtype)
    ids = torch.tensor([[7] * lead + [3] * 3 * c]) if lead else None
    kw = dict(chunk_size=c, top_k=2, document_ids=ids)
    official = oracle.dense_mask(q, k, **kw)
    exact = oracle.dense_mask(q, k, **kw, round_means=False)
    last, A, B = (slice(lead + i * c, lead + (i + 1) * c) for i in (2, 0, 1))
    assert official[0, 0, last, A].all() and not official[0, 0, last, B].any(), "the input picks A"
    assert exact[0, 0, last, B].all(), "unrounded means would pick B"
    assert torch.equal(dense_moba_mask(select_chunks(q, k, **kw)), official)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@with_examples("gqa_choice", "tiles_choice", "all_at_once")
@given(problems(choose=True))
def test_low_precision_gate_takes_a_top_k_of_the_official_scores(dtype, problem):
    """In bf16/fp16 exact ties are common, so any top-k of the oracle's scores is accepted."""
    problem = problem.to(dtype)
    chunks = moba_selection(problem.q, problem.k, **problem.kwargs)
    for (b, h, t), (_, own, scores) in oracle.past_scores(problem.q, problem.k, problem.chunk_size,
                                                          problem.granularity, problem.document_ids).items():
        row = chunks[b, h, t]
        assert row[own] and not row[own + 1:].any(), (problem, b, h, t)
        picked = [scores[j] for j in range(own) if row[j]]
        left = [scores[j] for j in range(own) if not row[j]]
        assert len(picked) == min(problem.top_k - 1, own), (problem, b, h, t)
        if picked and left:
            slack = 1e-6 * max(1.0, abs(max(left)))
            assert min(picked) >= max(left) - slack, (problem, b, h, t, picked, left)


@pytest.mark.parametrize("documents", [False, True], ids=["grid", "documents"])
def test_the_gate_selects_in_fp32_under_bf16_autocast(documents):
    """A model trained under CPU autocast gates as without it: the score products and the pooled maxima
    stay fp32 (bf16 products would reorder near-equal chunks)."""
    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 4096, 16), torch.randn(1, 2, 4096, 16)
    ids = (torch.arange(4096) // 1500)[None] if documents else None
    expected = select_chunks(q, k, chunk_size=64, top_k=4, document_ids=ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = select_chunks(q, k, chunk_size=64, top_k=4, document_ids=ids)
    assert torch.equal(got.chunks, expected.chunks)


@pytest.mark.parametrize("rows", [2, 7, 64, 300])
def test_cpu_max_pool2d_returns_the_first_row_of_equal_maxima(rows):
    """The pooled maxima (:mod:`flexmoba.gate.maxima`) rely on this property of CPU ``max_pool2d``,
    which torch does not document: of equal maxima in a window, the index of the first. Columns of
    all-equal, two-equal and distinct values, viewed channels last as the gate views them."""
    columns = torch.stack([torch.ones(rows), torch.arange(rows) % 2, torch.arange(rows).float()], -1)  # [rows, 3]
    planes = columns.contiguous().view(1, rows, 1, 3).permute(0, 3, 1, 2)  # [1, 3, rows, 1], channels last
    best, index = torch.nn.functional.max_pool2d(planes, (rows, 1), return_indices=True)
    assert index.flatten().tolist() == [0, 1, rows - 1]
    assert best.flatten().tolist() == [1.0, 1.0, rows - 1.0]


@pytest.mark.parametrize("n_chunks, pair_scores", [(2048, 512), (2048, 32 * 512), (64, 4 * 512), (3, 1), (2, 7)])
@pytest.mark.parametrize("budget", [1, 2**22, 2**26])
def test_query_chunk_groups_tile_every_query_chunk_within_the_buffer(n_chunks, pair_scores, budget):
    """Groups cover chunks 1 .. N-1 once, in order; each group's buffer (its chunks against every chunk
    before its last) fits the budget unless the group is one query chunk, the least there is."""
    with use_tuning("cpu", gate_buffer_scores=budget) as tuning:
        groups = query_chunk_groups(n_chunks, pair_scores, tuning)
    assert [c for first, end in groups for c in range(first, end)] == list(range(1, n_chunks))
    for first, end in groups:
        assert end - first == 1 or pair_scores * (end - first) * (end - 1) <= budget, (first, end)


@pytest.mark.parametrize("profile", ["cpu", "cuda"])
def test_position_spans_keep_every_span_within_the_buffer(profile):
    """1M positions (B 1, 32 heads, 2048 chunks): far past 16 spans, each span's scores of every chunk within
    the budget, the positions covered once (on CPU from the first with a past chunk: chunk 0's select none)."""
    S, heads, n_chunks = 2**20, 32, 2048
    own = (torch.arange(S) // 512)[None]
    with use_tuning(profile) as tuning:
        spans = position_spans(own, heads, n_chunks)
    assert spans[0][0] <= 512 and spans[-1][1] == S
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert len(spans) > 16
    assert max(heads * (end - start) * n_chunks for start, end, _, _ in spans) <= tuning.gate_buffer_scores
