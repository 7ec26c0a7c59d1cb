"""Non-finite inputs: a NaN never wins a gate slot; it shows up only where it is attended."""

import pytest
import torch

from flexmoba import MoBAKVCache, moba_attention, moba_decode_attention, moba_selection

from maxima_paths import MAXIMA_PATHS, maxima_path


def test_nan_key_chunk_is_never_selected_as_a_past_chunk():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 1, 64, 8), torch.randn(1, 1, 64, 8), torch.randn(1, 1, 64, 8)
    k[0, 0, 20] = float("nan")  # poisons chunk 2 (positions 16..23) and its mean
    chunks = moba_selection(q, k, chunk_size=8, top_k=3)
    own_chunk = torch.arange(64) // 8
    past_rows = own_chunk != 2
    assert not chunks[0, 0, past_rows, 2].any(), "the NaN chunk must not be selected by later queries"
    # Queries after it still get top_k chunks when enough finite past chunks exist.
    counts = chunks[0, 0].sum(-1)
    assert (counts[own_chunk >= 4] == 3).all()

    # Queries that attend the NaN key (its own chunk, 20..23) never get a plausible finite
    # value: sdpa gives NaN; torch's CPU flex kernel zeroes such rows. Dense sdpa may also
    # spread the NaN to rows that mask it out (0 * NaN); flex leaves those rows exact.
    with torch.no_grad():
        sdpa = moba_attention(q, k, v, chunk_size=8, top_k=3, backend="sdpa")
        flex = moba_attention(q, k, v, chunk_size=8, top_k=3, backend="flex")
        clean_k = k.clone()
        clean_k[0, 0, 20] = 0.0
        clean = moba_attention(q, clean_k, v, chunk_size=8, top_k=3, backend="sdpa")
    assert torch.isnan(sdpa[0, 0, 20:24]).all()
    attended = flex[0, 0, 20:24]
    assert (~torch.isfinite(attended) | (attended == 0)).all(1).all()
    # Rows before the NaN key neither attend it nor gate on its chunk's mean.
    torch.testing.assert_close(flex[0, 0, :20], clean[0, 0, :20], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", MAXIMA_PATHS)
@pytest.mark.parametrize("documents", [False, True], ids=["grid", "documents"])
def test_nan_scores_never_win_a_slot_on_any_maxima_path(documents, path):
    """NaN gate scores (a NaN key's chunk for every later query; every chunk for a NaN query) are never
    selected, on every path the gate takes maxima, while finite chunks still fill the slots."""
    q, k = torch.randn(1, 1, 64, 8), torch.randn(1, 1, 64, 8)
    k[0, 0, 20] = float("nan")  # chunk 2's mean
    q[0, 0, 50] = float("nan")
    ids = torch.zeros(1, 64, dtype=torch.long) if documents else None
    with maxima_path(path):
        chunks = moba_selection(q, k, chunk_size=8, top_k=3, document_ids=ids)[0, 0]
    later = torch.arange(24, 64) != 50
    assert not chunks[24:64][later, 2].any()
    assert (chunks[32:64][torch.arange(32, 64) != 50].sum(-1) == 3).all()
    assert chunks[50].nonzero().flatten().tolist() == [6]


def test_nan_query_selects_only_its_own_chunk():
    q, k = torch.randn(1, 1, 64, 8), torch.randn(1, 1, 64, 8)
    q[0, 0, 50] = float("nan")
    chunks = moba_selection(q, k, chunk_size=8, top_k=3)
    assert chunks[0, 0, 50].nonzero().flatten().tolist() == [6]


def test_decode_does_not_read_the_values_of_a_nan_chunk_it_did_not_select():
    """A NaN key poisons its chunk's mean, so the chunk loses its gate slot; the unused slot must
    not read that chunk's values either (0 * NaN would reach the output)."""
    torch.manual_seed(0)
    c, D = 8, 8
    k, v = torch.randn(1, 1, 2 * c + 3, D), torch.randn(1, 1, 2 * c + 3, D)  # the own chunk holds 3 keys
    k[:, :, 0], v[:, :, 0] = float("nan"), float("nan")
    q = torch.randn(1, 2, 1, D)
    cache = MoBAKVCache(c)
    cache.update(k, v)
    out = moba_decode_attention(q, cache, top_k=3, backend="gather")
    keys, values = k[:, :, c:], v[:, :, c:]  # chunk 1 and the own chunk: all the query may attend
    expected = torch.softmax(q @ keys.transpose(-1, -2) * D**-0.5, dim=-1) @ values
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("path", MAXIMA_PATHS)
@pytest.mark.parametrize("documents", [False, True], ids=["grid", "documents"])
def test_infinite_gate_scores_minus_inf_is_never_selected_plus_inf_wins(documents, path):
    """A chunk whose gate score is -inf is never selected, even with a free slot; one at +inf wins
    its slot. With documents (one here) the gate takes its other path; every maxima path forced."""
    q, k = torch.ones(1, 1, 40, 1), torch.randn(1, 1, 40, 1, generator=torch.Generator().manual_seed(0))
    k[0, 0, 8:16] = float("-inf")  # chunk 1 scores -inf
    k[0, 0, 24:32] = float("inf")  # chunk 3 scores +inf
    ids = torch.zeros(1, 40, dtype=torch.long) if documents else None
    with maxima_path(path):
        chunks = moba_selection(q, k, chunk_size=8, top_k=3, document_ids=ids)[0, 0]
    assert chunks[16:24].nonzero()[:, 1].unique().tolist() == [0, 2], "two past slots, chunk 1 left free"
    assert chunks[32:40, 3].all() and not chunks[32:40, 1].any()
