"""The closed-form pair counts equal counting query by query."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flexmoba import select_chunks
from flexmoba.pair_counts import keys_attended_full, keys_attended_moba, past_chunk_slots, selection_pairs

import oracle
from strategies import more_examples, problems


def moba_pairs_by_query(seq_len: int, chunk_size: int, top_k: int) -> tuple[int, int]:
    """(query-key pairs, query-past-chunk pairs), one query at a time."""
    keys = past_chunks = 0
    for t in range(seq_len):
        own = t // chunk_size
        past = min(top_k - 1, own)
        keys += (t - own * chunk_size + 1) + past * chunk_size
        past_chunks += past
    return keys, past_chunks


lengths = st.integers(0, 3000)
chunks = st.one_of(st.integers(1, 8), st.integers(1, 600))
top_ks = st.one_of(st.integers(1, 4), st.integers(1, 40))


@more_examples()
@given(lengths, chunks, top_ks)
def test_closed_forms_equal_the_per_query_count(seq_len, chunk_size, top_k):
    keys, past_chunks = moba_pairs_by_query(seq_len, chunk_size, top_k)
    assert keys_attended_moba(seq_len, chunk_size, top_k) == keys
    assert past_chunk_slots(seq_len, chunk_size, top_k) == past_chunks


@pytest.mark.parametrize("seq_len, chunk_size, top_k", [
    (1, 1, 1), (7, 1, 1), (7, 1, 3), (8, 4, 2), (9, 4, 2), (9, 4, 3), (9, 4, 50), (3, 10, 2), (100, 7, 5)])
def test_edges_of_the_grid(seq_len, chunk_size, top_k):
    keys, past_chunks = moba_pairs_by_query(seq_len, chunk_size, top_k)
    assert (keys_attended_moba(seq_len, chunk_size, top_k), past_chunk_slots(seq_len, chunk_size, top_k)) == (
        keys, past_chunks)


def test_enough_chunks_is_full_attention():
    for seq_len in range(1, 200):
        assert keys_attended_moba(seq_len, 16, -(-seq_len // 16)) == keys_attended_full(seq_len)


@pytest.mark.parametrize("name, args", [("chunk_size", (10, 0, 2)), ("top_k", (10, 4, 0))])
def test_bad_sizes_name_the_parameter(name, args):
    with pytest.raises(ValueError, match=name):
        past_chunk_slots(*args)


@given(problems())
def test_a_selections_pairs_are_its_dense_masks_count(problem):
    selection = select_chunks(problem.q, problem.k, **problem.kwargs)
    assert selection_pairs(selection) == int(oracle.dense_mask(problem.q, problem.k, **problem.kwargs).sum())
