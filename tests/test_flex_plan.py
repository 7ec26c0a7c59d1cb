"""The regrouped FlexAttention plan: exact against the oracle, block-sparse, static in shape."""

import pytest
import torch
from flex_standin import flex_standin
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import flex_attention

from flexmoba import MobaSpec, compiled_flex_attention, moba_flex_plan, select_chunks
from flexmoba.backends.flex import plan as flex_plan_module
from flexmoba.backends.flex.plan import plan_from_selection
from flexmoba.gate import select_local_chunks
from flexmoba.tuning import use_tuning

import oracle
from strategies import Problem, problems, random_inputs


def plan_of(problem, **kw):
    return moba_flex_plan(problem.q, problem.k, chunk_size=problem.chunk_size, top_k=problem.top_k,
                          document_ids=problem.document_ids, granularity=problem.granularity, **kw)


def oracle_out(problem, scale=None):
    return oracle.attention(problem.q, problem.k, problem.v, scale=scale, **problem.kwargs)


def gqa_choice_problem():
    q, k, v = random_inputs(3, 1, 4, 2, 37, 8)
    return Problem(q, k, v, chunk_size=5, top_k=3, granularity="token", document_ids=None)


def documents_problem():
    q, k, v = random_inputs(4, 2, 2, 1, 30, 4)
    ids = torch.tensor([[7] * 9 + [3] * 4 + [7] * 12 + [1] + [7] * 4, [0] * 30])
    return Problem(q, k, v, chunk_size=4, top_k=2, granularity="token", document_ids=ids)


@example(gqa_choice_problem(), 8, False)
@example(documents_problem(), 4, True)
@given(problems(), st.sampled_from([4, 8, 16]), st.booleans())
def test_plan_through_eager_flex_equals_oracle(problem, block, sink):
    """Eager flex reads only the mask_mod; with ``sink`` the log-sum-exp comes from the sink key."""
    plan = plan_of(problem, block_size=block, sink=sink)
    got = plan.attention(problem.q, problem.k, problem.v, flex=flex_attention)
    torch.testing.assert_close(got.double(), oracle_out(problem), atol=1e-5, rtol=1e-5)


@given(problems(max_seq_len=40), st.floats(0.05, 2.0))
def test_plan_custom_scale_equals_oracle(problem, scale):
    plan = plan_of(problem, block_size=8, sink=True)
    got = plan.attention(problem.q, problem.k, problem.v, scale=scale, flex=flex_attention)
    torch.testing.assert_close(got.double(), oracle_out(problem, scale), atol=1e-5, rtol=1e-5)


def dense_virtual_mask(plan, query_start=0):
    """``[B, H_kv, L, kv_len]`` bool: which keys each virtual row attends (sink included)."""
    T = query_start + plan.selection.chunks.shape[2]
    keys = torch.arange(T + int(plan.sink))
    mask = (keys >= plan.key_start[..., None]) & (keys < plan.key_end[..., None])
    if plan.sink:
        mask[..., T] = plan.key_end > 0
    return mask


def listed_blocks(num, indices, n_blocks):
    listed = torch.zeros(*num.shape, n_blocks, dtype=torch.bool)
    for idx in zip(*torch.nonzero(torch.ones_like(num), as_tuple=True), strict=True):
        listed[idx + (indices[idx][: num[idx]].long(),)] = True
    return listed


BLOCK_SIZES = [(4, 4), (8, 4), (4, 8), (16, 16)]


def assert_tables_match_the_dense_virtual_mask(plan, block_size, query_start=0):
    """Compiled kernels skip the mask_mod on "full" blocks: a block must be full exactly
    when every pair in it is attended, partial when some are, and listed otherwise never."""
    Bq, Bk = block_size
    mask = dense_virtual_mask(plan, query_start)
    L, kv_len = mask.shape[-2:]
    n_tiles, n_blocks = -(-L // Bq), -(-kv_len // Bk)
    padded = torch.zeros(*mask.shape[:2], n_tiles * Bq, n_blocks * Bk, dtype=torch.bool)
    padded[..., :L, :kv_len] = mask
    inside = torch.zeros_like(padded)
    inside[..., :L, :kv_len] = True
    tiles = lambda x: x.view(*x.shape[:2], n_tiles, Bq, n_blocks, Bk)  # noqa: E731
    attended = tiles(padded).sum((3, 5))
    area = tiles(inside).sum((3, 5))
    bm = plan.block_mask
    full = listed_blocks(bm.full_kv_num_blocks, bm.full_kv_indices, n_blocks)
    partial = listed_blocks(bm.kv_num_blocks, bm.kv_indices, n_blocks)
    assert torch.equal(full, attended == area)
    assert torch.equal(partial, (attended > 0) & (attended < area))


@given(problems(max_seq_len=48), st.sampled_from(BLOCK_SIZES), st.booleans())
def test_block_tables_match_the_dense_virtual_mask(problem, block_size, sink):
    assert_tables_match_the_dense_virtual_mask(plan_of(problem, block_size=block_size, sink=sink), block_size)


def long_chunks_problem():
    q, k, v = random_inputs(5, 1, 2, 1, 32, 4)
    return Problem(q, k, v, chunk_size=16, top_k=2, granularity="token", document_ids=None)


# Query 3 is the first of a query block and its row ends where key block 0 does: full, not partial.
@example(long_chunks_problem(), (4, 4), False, 3)
@given(problems(max_seq_len=48), st.sampled_from(BLOCK_SIZES), st.booleans(), st.integers(0, 47))
def test_block_tables_of_queries_after_a_prefix_match_the_dense_virtual_mask(problem, block_size, sink, query_start):
    """Context parallelism's plans: the queries are positions ``[query_start, T)`` of T keys."""
    query_start %= problem.q.shape[2]
    spec = MobaSpec(problem.chunk_size, problem.top_k)
    selection = select_local_chunks(problem.q[:, :, query_start:], problem.k, spec, query_start,
                                     problem.document_ids)
    plan = plan_from_selection(selection, problem.k.shape[1], block_size=block_size, sink=sink,
                               query_start=query_start)
    assert_tables_match_the_dense_virtual_mask(plan, block_size, query_start)


def test_the_tables_are_as_wide_as_a_block_of_rows_reads_not_every_key_block():
    """Memory linear in S: four times the keys, the same table width (a chunk and a block, plus the sink)."""
    widths = []
    for seq_len in (4096, 16384):
        q, k, _ = random_inputs(0, 1, 2, 1, seq_len, 8)
        plan = moba_flex_plan(q, k, chunk_size=256, top_k=3, sink=True)
        partial_count, partial, full_count, full = plan.tables
        assert partial.shape == full.shape == (*partial_count.shape, partial.shape[-1])
        widths.append(partial.shape[-1])
    assert widths[0] == widths[1] <= (256 + 128 - 2) // 128 + 3, widths


def piece_tables(plan):
    """The four tables of every piece's widened mask, joined in order of rows."""
    length = plan.virtual_len // plan.pieces
    masks = [plan.piece_block_mask(start, start + length) for start in range(0, plan.virtual_len, length)]
    names = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
    return [torch.cat([getattr(m, name) for m in masks], 2) for name in names]


@given(problems(max_seq_len=48), st.sampled_from(BLOCK_SIZES), st.booleans(), st.integers(1, 60))
def test_a_plan_in_pieces_holds_the_same_rows_and_tables_in_equal_pieces_within_the_budget(
        problem, block_size, sink, entries):
    whole = plan_of(problem, block_size=block_size, sink=sink)
    with use_tuning("cpu", flex_table_entries=entries):
        plan = plan_of(problem, block_size=block_size, sink=sink)
    Bq, Bk = block_size
    B, H_kv, L = plan.key_start.shape
    row_entries = B * H_kv * -(-plan.kv_len // Bk)
    per_piece = plan.virtual_len // plan.pieces
    assert plan.virtual_len % plan.pieces == 0 and per_piece % Bq == 0
    assert per_piece // Bq == 1 or per_piece // Bq * row_entries <= entries
    assert plan.virtual_len - whole.virtual_len < per_piece  # padding: less than a piece
    padding = slice(whole.virtual_len, None)
    assert (plan.key_end[..., padding] == 0).all()
    for name in ("key_start", "key_end", "source"):
        assert torch.equal(getattr(plan, name)[..., : whole.virtual_len], getattr(whole, name)), name
    assert torch.equal(plan.rows, whole.rows)
    whole_mask = whole.block_mask
    rows = whole.virtual_len // Bq
    for got, name in zip(piece_tables(plan), ("kv_num_blocks", "kv_indices", "full_kv_num_blocks",
                                              "full_kv_indices"), strict=True):
        want = getattr(whole_mask, name)
        assert torch.equal(got[:, :, :rows], want), name
        assert not got[:, :, rows:].any(), name  # the padding blocks list nothing
    assert_tables_match_the_dense_virtual_mask(plan, block_size)


@given(problems(max_seq_len=48), st.sampled_from([4, 8]), st.booleans(), st.integers(1, 60))
@settings(max_examples=30)
def test_a_plan_in_pieces_through_the_table_reading_standin_equals_oracle(problem, block, sink, entries):
    """Each piece's tables as the kernel reads them (a wrong or missing block shows)."""
    with use_tuning("cpu", flex_table_entries=entries):
        plan = plan_of(problem, block_size=block, sink=sink)
    got = plan.attention(problem.q, problem.k, problem.v, flex=flex_standin)
    torch.testing.assert_close(got.double(), oracle_out(problem), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_compiled_cpu_flex_in_pieces_equals_oracle():
    q, k, v, kw = compiled_case(COMPILED_CASES[1], 0)
    with use_tuning("cpu", flex_table_entries=1):  # one block of rows per piece
        plan = moba_flex_plan(q, k, block_size=16, **kw)
    assert plan.sink and plan.pieces == plan.virtual_len // 16 > 1
    with torch.no_grad():
        got = plan.attention(q, k, v, flex=compiled_flex_attention())
    torch.testing.assert_close(got.double(), oracle.attention(q, k, v, **kw), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seq_len", [8192, 32768])
def test_visited_area_is_close_to_the_attended_pairs(seq_len):
    """The paper's 32K setting (chunk 512, top-3): the kernel's blocks cover at most 1.3x the
    (query, key) pairs MoBA attends, where a union mask over the original order covers ~all."""
    q, k, _ = random_inputs(0, 1, 2, 1, seq_len, 8)
    for sink in (False, True):
        plan = moba_flex_plan(q, k, chunk_size=512, top_k=3, sink=sink)
        selection = plan.selection
        own = torch.arange(seq_len) % 512 + 1
        attended = 2 * int(own.sum()) + 512 * int(selection.past_valid.sum())  # 2 query heads
        assert plan.visited_area() <= 1.3 * attended, (sink, plan.visited_area() / attended)


@given(problems(max_seq_len=40), st.integers(0, 2**31 - 1))
@settings(max_examples=15)
def test_virtual_length_does_not_depend_on_the_selection(problem, seed):
    plan = plan_of(problem, block_size=8)
    other = torch.randn(problem.q.shape, generator=torch.Generator().manual_seed(seed))
    other_plan = moba_flex_plan(other, problem.k.flip(2), chunk_size=problem.chunk_size, top_k=problem.top_k,
                                document_ids=problem.document_ids, granularity=problem.granularity, block_size=8)
    assert plan.virtual_len == other_plan.virtual_len
    assert plan.block_mask.kv_indices.shape == other_plan.block_mask.kv_indices.shape


def test_sink_recovers_rows_whose_sink_weight_underflows():
    """A key 300 nats above the sink constant underflows p = exp(c - LSE) to 0 in fp32;
    those rows' log-sum-exp is recomputed directly."""
    q, k, v = random_inputs(5, 1, 1, 1, 24, 4)
    q[0, 0, 13] = torch.tensor([40.0, 0, 0, 0])
    k[0, 0, 12] = torch.tensor([15.0, 0, 0, 0])  # own chunk of query 13: q . k * scale = 300
    k[0, 0, 2] = torch.tensor([15.0, 0, 0, 0])  # and a past chunk's key
    problem = Problem(q, k, v, chunk_size=6, top_k=2, granularity="token", document_ids=None)
    plan = plan_of(problem, block_size=8, sink=True)
    got = plan.attention(q, k, v, flex=flex_attention)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), oracle_out(problem), atol=1e-5, rtol=1e-5)


def test_cpu_default_is_the_sink_and_the_plan_without_it_needs_a_flex_that_returns_lse():
    q, k, v = random_inputs(0, 1, 2, 1, 40, 8)
    assert moba_flex_plan(q, k, chunk_size=8, top_k=3).sink
    plan = moba_flex_plan(q, k, chunk_size=8, top_k=3, sink=False)
    expected = oracle.attention(q, k, v, chunk_size=8, top_k=3)
    torch.testing.assert_close(plan.attention(q, k, v, flex=flex_attention).double(), expected, atol=1e-5, rtol=1e-5)


# Compiled kernels are specialised per shape: a few fixed shapes, several selections each.
COMPILED_CASES = [  # (B, H, H_kv, S, D, chunk_size, top_k, with documents)
    (1, 2, 1, 96, 8, 16, 3, False),
    (2, 4, 2, 80, 8, 16, 2, True),
    (1, 2, 2, 50, 8, 16, 1, False),
    (1, 2, 1, 72, 8, 16, 9, True),
]


def compiled_case(case, seed):
    B, H, H_kv, S, D, chunk_size, top_k, documents = case
    ids = torch.tensor([[0] * (S // 3) + [1] * (S - S // 3 - 1) + [0]] * B) if documents else None
    q, k, v = random_inputs(seed, B, H, H_kv, S, D)
    return q, k, v, dict(chunk_size=chunk_size, top_k=top_k, document_ids=ids)


@pytest.mark.slow
@settings(max_examples=12)
@given(st.sampled_from(COMPILED_CASES), st.integers(0, 2**31 - 1))
def test_compiled_cpu_flex_with_sink_equals_oracle(case, seed):
    q, k, v, kw = compiled_case(case, seed)
    plan = moba_flex_plan(q, k, block_size=16, **kw)
    assert plan.sink
    with torch.no_grad():
        got = plan.attention(q, k, v, flex=compiled_flex_attention())
    torch.testing.assert_close(got.double(), oracle.attention(q, k, v, **kw), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("case", COMPILED_CASES, ids=str)
def test_a_new_selection_of_one_shape_does_not_recompile(case):
    flex = compiled_flex_attention()
    for seed in range(3):
        q, k, v, kw = compiled_case(case, seed)
        plan = moba_flex_plan(q, k, block_size=16, **kw)
        with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=seed > 0):
            plan.attention(q, k, v, flex=flex)


def test_each_selected_pair_has_its_own_virtual_row_reading_its_chunk():
    q, k, _ = random_inputs(1, 2, 4, 2, 45, 4)
    ids = torch.tensor([[0] * 20 + [1] * 25, [2] * 45])
    chunk = 5
    selection = select_chunks(q, k, chunk_size=chunk, top_k=4, document_ids=ids)
    plan = flex_plan_module.plan_from_selection(selection, kv_heads=2, block_size=8)
    B, H, S, K = plan.rows.shape
    seen = set()
    for b, h, t, slot in plan.valid.nonzero().tolist():
        kv_head, head_in_group = divmod(h, H // 2)
        row = int(plan.rows[b, h, t, slot])
        assert (b, kv_head, row) not in seen, "two pairs share a virtual row"
        seen.add((b, kv_head, row))
        assert int(plan.source[b, kv_head, row]) == head_in_group * S + t
        doc_start = 0 if b == 1 or t < 20 else 20
        if slot == 0:
            expected = (doc_start + (t - doc_start) // chunk * chunk, t + 1)
        else:
            expected = (doc_start + int(selection.past_chunks[b, h, t, slot - 1]) * chunk,) * 2
            expected = (expected[0], expected[0] + chunk)
        assert (int(plan.key_start[b, kv_head, row]), int(plan.key_end[b, kv_head, row])) == expected
    assert len(seen) == int(plan.valid.sum())
