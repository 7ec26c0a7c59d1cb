"""mask_mods never index a captured tensor past int32 offsets (some FlexAttention versions
inline that index arithmetic in int32: a silently wrong mask). Checked at the boundary on
the meta device, where a [1, 2, 32768, 32768] selection costs no memory."""

import pytest
import torch
from flex_standin import flex_standin

from flexmoba import MobaSpec, moba_attention, select_chunks, use_flex_attention
from flexmoba.gate import Selection
from flexmoba.layout import chunk_layout
from flexmoba.masks import MAX_FLEX_OFFSET, check_flex_index, largest_offset, moba_mask_mod

META = torch.device("meta")


def meta_selection(B, H, S, P):
    """A selection of ``P`` past slots per query, a width no real gate of S tokens returns past S."""
    layout = chunk_layout(B, S, 1, META)
    past = torch.empty(B, H, S, P, dtype=torch.long, device=META)
    return Selection(past, past.bool(), layout, MobaSpec(chunk_size=1, top_k=P + 1))


def test_the_limit_is_int32():
    assert MAX_FLEX_OFFSET == 2**31 - 1 == torch.iinfo(torch.int32).max


def test_union_mask_mod_at_the_boundary():
    moba_mask_mod(meta_selection(1, 2, 2**15, 2**15))  # 2**31 elements: last offset 2**31 - 1
    # one more slot: 2 * 32768 * 32769 = 2**31 + 2**16 elements, last offset 2**31 + 2**16 - 1
    with pytest.raises(ValueError, match=r"selection.past_chunks \[1, 2, 32768, 32769\] reaches element offset "
                                         r"2,147,549,183.*backend='flex'"):
        moba_mask_mod(meta_selection(1, 2, 2**15, 2**15 + 1))


def test_union_mask_mod_indexes_the_selected_chunks_not_every_chunk():
    """Its captured tensors are [B, H, S, top_k - 1]: 2**15 + 1 chunks of one token (a [B, H, S, n_chunks]
    table of 2**31 + 2**16 elements) index far inside int32."""
    q = torch.empty(1, 2, 2**15 + 1, 4, device=META)
    moba_mask_mod(select_chunks(q, q, chunk_size=1, top_k=2))


def test_offsets_follow_strides_not_element_counts():
    assert largest_offset((2**31,)) == MAX_FLEX_OFFSET
    assert largest_offset((2**31 + 1,)) == MAX_FLEX_OFFSET + 1
    expanded = torch.empty(1, 1, 1, 2**16, device=META).expand(2**16, 1, 1, 2**16)  # stride 0 over the batch
    assert largest_offset(expanded) == 2**16 - 1
    check_flex_index("expanded", expanded, "")
    sliced = torch.empty(2**31 + 2, dtype=torch.bool, device=META)[2:]
    assert largest_offset(sliced) == MAX_FLEX_OFFSET + 2


def test_flex_union_refuses_a_selection_past_int32_and_names_the_way_out():
    q = torch.empty(1, 2**10 + 1, 2**20, 4, device=META)  # top_k 3: ids [1, 1025, 2**20, 2], 2**31 + 2**21 elements
    with use_flex_attention(flex_standin), pytest.raises(ValueError, match="int32.*backend='flex'"):
        moba_attention(q, q, q, chunk_size=8192, top_k=3, backend="flex_union")


def test_the_regrouped_plan_runs_on_a_meta_million_tokens():
    q = torch.empty(1, 2, 2**20, 4, device=META)
    with use_flex_attention(flex_standin):
        assert moba_attention(q, q, q, chunk_size=512, top_k=3, backend="flex").shape == q.shape


def test_the_plan_refuses_virtual_rows_past_int32():
    """B * H_kv * L past 2**31: with chunk 1 and top_k 2, L = 2 * S (own rows plus one past row each)."""
    q = torch.empty(2**16, 1, 2**15 + 64, 4, device=META)
    with use_flex_attention(flex_standin), pytest.raises(ValueError, match=r"plan.key_start.*int32.*split the batch"):
        moba_attention(q, q, q, chunk_size=2**15, top_k=2, backend="flex")
