"""The BlockMask: its mask_mod equals the oracle, its tables are an exact acceleration."""

from unittest import mock

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import _transpose_ordered, flex_attention

import flexmoba.backends.flex.block_mask as block_mask_module
from flexmoba import (
    compiled_flex_attention,
    moba_block_mask,
    moba_reference,
    moba_selection,
    select_chunks,
    selection_block_mask,
)
from flexmoba.backends.flex.block_mask import listed_width, transposed_table

import oracle
from strategies import EXAMPLES, FLEX_SHAPES, problems, random_inputs


def element_states(block_mask, S):
    """[B, H, S, S] int: 0 skipped, 1 partial, 2 full, read plainly off the kv tables."""
    Bq, Bk = block_mask.BLOCK_SIZE
    B, H, n_tiles = block_mask.kv_num_blocks.shape
    states = torch.zeros(B, H, S, S, dtype=torch.long)
    tables = [(block_mask.kv_num_blocks, block_mask.kv_indices, 1),
              (block_mask.full_kv_num_blocks, block_mask.full_kv_indices, 2)]
    for num, idx, state in tables:
        for b in range(B):
            for h in range(H):
                for tile in range(n_tiles):
                    for kb in idx[b, h, tile, : num[b, h, tile]].tolist():
                        region = states[b, h, tile * Bq:(tile + 1) * Bq, kb * Bk:(kb + 1) * Bk]
                        assert (region == 0).all(), "a block is listed twice"
                        region.fill_(state)
    return states


def mask_mod_dense(block_mask, B, H, S):
    b, h, q, kv = torch.meshgrid(torch.arange(B), torch.arange(H), torch.arange(S), torch.arange(S), indexing="ij")
    return block_mask.mask_mod(b, h, q, kv)


def built_mask(problem, block_size, build):
    """The union mask, built at torch's full width in one group of tiles (``"whole"``), compact
    (``"compact"``), or a tile at a time (``"tile_by_tile"``)."""
    if build == "tile_by_tile":
        with mock.patch.object(block_mask_module, "TABLE_BUILD_ENTRIES", 1):
            return moba_block_mask(problem.q, problem.k, block_size=block_size, **problem.kwargs)
    selection = select_chunks(problem.q, problem.k, **problem.kwargs)
    block_mask = selection_block_mask(selection, block_size, compact=build == "compact")
    if build == "compact":
        counts = block_mask.kv_num_blocks + block_mask.full_kv_num_blocks
        assert int(counts.max()) <= listed_width(selection, block_size)  # the bound holds, so nothing was cut
    return block_mask


@pytest.mark.parametrize("build", ["whole", "compact", "tile_by_tile"])
@example(EXAMPLES["all_at_once"], 16, 8)
@example(EXAMPLES["reused_ids"], 7, 5)
@example(EXAMPLES["one_token_documents"], 4, 4)
@example(EXAMPLES["gqa_choice"], 6, 12)
@given(problems(max_seq_len=48), st.integers(1, 20), st.integers(1, 20))
def test_mask_mod_and_tables_are_exact(build, problem, block_q, block_kv):
    B, H, S, _ = problem.q.shape
    block_mask = built_mask(problem, (block_q, block_kv), build)
    expected = oracle.dense_mask(problem.q, problem.k, **problem.kwargs)
    assert torch.equal(mask_mod_dense(block_mask, B, H, S), expected), problem

    states = element_states(block_mask, S)
    for tile in range(-(-S // block_q)):
        for kb in range(-(-S // block_kv)):
            rows, cols = slice(tile * block_q, (tile + 1) * block_q), slice(kb * block_kv, (kb + 1) * block_kv)
            attended = expected[:, :, rows, cols].flatten(2)  # [B, H, pairs]
            state = states[:, :, rows, cols].flatten(2)[..., 0]
            assert torch.equal(state == 2, attended.all(-1)), ("full iff every pair attended", tile, kb)
            assert torch.equal(state == 1, attended.any(-1) & ~attended.all(-1)), ("partial", tile, kb)


def test_tables_are_int32_padded_to_all_kv_blocks():
    q, k, _ = random_inputs(0, 2, 2, 1, 300, 8)
    block_mask = moba_block_mask(q, k, chunk_size=32, top_k=3, block_size=(64, 32))
    assert block_mask.kv_indices.dtype == torch.int32 and block_mask.kv_num_blocks.dtype == torch.int32
    assert block_mask.kv_indices.shape == (2, 2, 5, 10)
    assert block_mask.full_kv_indices.shape == (2, 2, 5, 10)
    assert block_mask.seq_lengths == (300, 300)


def listed(num, indices):
    """Each row's listed entries, as lists: a table's meaning, whatever its width and padding."""
    return [row[:n] for row, n in zip(indices.flatten(0, -2).tolist(), num.flatten().tolist(), strict=True)]


def test_compact_tables_are_as_wide_as_a_tile_can_read_and_list_the_same_blocks():
    q, k, _ = random_inputs(0, 1, 2, 1, 4096, 8)
    selection = select_chunks(q, k, chunk_size=16, top_k=3)
    whole = selection_block_mask(selection, 16, compact=False)
    compact = selection_block_mask(selection, 16, compact=True)
    width = 2 + (16 + 16 - 2) // 16 + 16 * 2 * 2  # own blocks, then 16 queries x 2 chunks x 2 blocks
    assert listed_width(selection, (16, 16)) == width
    assert compact.kv_indices.shape == compact.full_kv_indices.shape == (1, 2, 256, width)
    assert whole.kv_indices.shape[-1] == 256
    for attr in ("kv", "full_kv", "q", "full_q"):
        num, indices = getattr(compact, f"{attr}_num_blocks"), getattr(compact, f"{attr}_indices")
        assert torch.equal(num, getattr(whole, f"{attr}_num_blocks")), attr
        assert listed(num, indices) == listed(num, getattr(whole, f"{attr}_indices")), attr


@given(problems(max_seq_len=48), st.integers(1, 20), st.integers(1, 20))
def test_transposed_table_lists_what_torch_s_transposition_lists(problem, block_q, block_kv):
    block_mask = moba_block_mask(problem.q, problem.k, block_size=(block_q, block_kv), **problem.kwargs)
    n_blocks = block_mask.kv_indices.shape[-1]
    for num, indices in ((block_mask.kv_num_blocks, block_mask.kv_indices),
                         (block_mask.full_kv_num_blocks, block_mask.full_kv_indices)):
        expected_num, expected_indices = _transpose_ordered(num, indices)
        got_num, got_indices = transposed_table(num, indices, n_blocks)
        assert got_indices.shape == expected_indices.shape and got_indices.dtype == torch.int32
        assert torch.equal(got_num, expected_num)
        assert listed(got_num, got_indices) == listed(expected_num, expected_indices)


@given(problems(max_seq_len=40, token_only=True))
def test_eager_flex_with_the_mask_equals_oracle(problem):
    # Eager flex applies only mask_mod: this checks the mask_mod carries the whole selection.
    block_mask = moba_block_mask(problem.q, problem.k, block_size=8, **problem.kwargs)
    got = flex_attention(problem.q, problem.k, problem.v, block_mask=block_mask,
                         enable_gqa=problem.q.shape[1] != problem.k.shape[1])
    kw = {key: val for key, val in problem.kwargs.items() if key != "granularity"}
    expected = oracle.attention(problem.q, problem.k, problem.v, **kw)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_new_masks_of_the_same_shape_do_not_recompile():
    B, H, H_kv, S, D = FLEX_SHAPES[0]
    flex = compiled_flex_attention()

    def run(seed):
        q, k, v = random_inputs(seed, B, H, H_kv, S, D)
        block_mask = moba_block_mask(q, k, chunk_size=8, top_k=3, block_size=16)
        out = flex(q, k, v, block_mask=block_mask, enable_gqa=True)
        torch.testing.assert_close(out, moba_reference(q, k, v, chunk_size=8, top_k=3), atol=1e-5, rtol=1e-5)
        return moba_selection(q, k, chunk_size=8, top_k=3)

    run(0)  # compile (or reuse) this shape's kernel
    with torch._dynamo.config.patch(error_on_recompile=True):
        selections = [run(seed) for seed in range(1, 6)]
    assert len({tuple(s.flatten().tolist()) for s in selections}) == 5, "the 5 masks should differ"
