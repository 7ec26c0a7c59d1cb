"""Bad input raises ValueError/TypeError naming the parameter, never a wrong answer."""

import pytest
import torch

from flexmoba import moba_attention, moba_attention_varlen, moba_block_mask, moba_reference, moba_selection

Q = torch.randn(1, 4, 32, 8)
KV = torch.randn(1, 2, 32, 8)
OK = dict(chunk_size=8, top_k=2)


@pytest.mark.parametrize("fn", [moba_attention, moba_reference])
@pytest.mark.parametrize(
    "q, k, v, kwargs, error, words",
    [
        (Q, KV[..., :4], KV, OK, ValueError, "k must be"),
        (Q, KV[:, :, :16], KV, OK, ValueError, "k must be"),
        (Q, torch.randn(1, 3, 32, 8), torch.randn(1, 3, 32, 8), OK, ValueError, "H % H_kv"),
        (Q, KV, KV[:, :, :16], OK, ValueError, "v must be"),
        (Q, KV.double(), KV, OK, TypeError, "k has dtype"),
        (Q, KV, KV.double(), OK, TypeError, "v has dtype"),
        (Q[0], KV, KV, OK, ValueError, "q must have 4 dims"),
        (Q.long(), KV, KV, OK, TypeError, "q must be a floating-point"),
        (Q, KV, KV, dict(chunk_size=0, top_k=2), ValueError, "chunk_size must be >= 1"),
        (Q, KV, KV, dict(chunk_size=8.0, top_k=2), TypeError, "chunk_size must be an int"),
        (Q, KV, KV, dict(chunk_size=8, top_k=0), ValueError, "top_k must be >= 1"),
        (Q, KV, KV, dict(chunk_size=8, top_k=True), TypeError, "top_k must be an int"),
        (Q, KV, KV, dict(chunk_size=8, top_k=2, granularity="tile"), ValueError, "granularity"),
        (Q, KV, KV, dict(chunk_size=8, top_k=2, granularity=3), ValueError, "granularity=3 must divide"),
        (Q, KV, KV, dict(chunk_size=8, top_k=2, scale="big"), TypeError, "scale"),
        (Q, KV, KV, dict(chunk_size=8, top_k=2, document_ids=torch.zeros(1, 31, dtype=torch.long)),
         ValueError, "document_ids must be"),
        (Q, KV, KV, dict(chunk_size=8, top_k=2, document_ids=torch.zeros(1, 32)), TypeError, "document_ids"),
    ],
)
def test_bad_input_names_the_parameter(fn, q, k, v, kwargs, error, words):
    with pytest.raises(error, match=words):
        fn(q, k, v, **kwargs)


def test_device_mismatch_names_the_tensor():
    meta_k = torch.empty(1, 2, 32, 8, device="meta")
    with pytest.raises(ValueError, match="k is on meta"):
        moba_attention(Q, meta_k, KV, **OK)


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of"):
        moba_attention(Q, KV, KV, backend="triton", **OK)


def test_flex_refuses_cpu_gradients():
    q = Q.clone().requires_grad_()
    with pytest.raises(ValueError, match="backend='flex' cannot compute gradients on CPU"):
        moba_attention(q, KV, KV, backend="flex", **OK)


@pytest.mark.parametrize("fn", [moba_selection, moba_block_mask])
def test_selection_and_block_mask_check_their_inputs(fn):
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        fn(Q, KV, chunk_size=8, top_k=-1)
    with pytest.raises(ValueError, match="H % H_kv"):
        fn(Q, torch.randn(1, 3, 32, 8), **OK)


def test_block_size_must_be_positive():
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        moba_block_mask(Q, KV, block_size=0, **OK)


T = torch.randn(10, 2, 8)


@pytest.mark.parametrize(
    "cu_seqlens, words",
    [
        (torch.tensor([1, 10], dtype=torch.int32), "must start at 0"),
        (torch.tensor([0, 6, 4, 10], dtype=torch.int32), "strictly increasing"),
        (torch.tensor([0, 4, 4, 10], dtype=torch.int32), "strictly increasing"),
        (torch.tensor([0, 4, 9], dtype=torch.int32), "must end at the number of tokens 10"),
        (torch.tensor([0, 10.0]), "integer"),
        (torch.tensor([[0, 10]], dtype=torch.int32), "1-D"),
    ],
)
def test_bad_cu_seqlens(cu_seqlens, words):
    with pytest.raises((ValueError, TypeError), match=words):
        moba_attention_varlen(T, T, T, cu_seqlens, **OK)


def test_varlen_rejects_document_ids_and_wrong_rank():
    cu = torch.tensor([0, 10], dtype=torch.int32)
    with pytest.raises(TypeError, match="document_ids"):
        moba_attention_varlen(T, T, T, cu, document_ids=None, **OK)
    with pytest.raises(ValueError, match=r"q must be a \[T, heads, head_dim\]"):
        moba_attention_varlen(T[None], T, T, cu, **OK)


def test_tensors_in_the_sequence_first_layout_get_the_transpose_named():
    q, k = torch.randn(1, 64, 4, 8), torch.randn(1, 64, 2, 8)  # [B, S, H, D], GQA
    with pytest.raises(ValueError, match=r"look like \[B, S, H, D\]: pass q.transpose\(1, 2\)"):
        moba_attention(q, k, k, chunk_size=16, top_k=2)
    with pytest.raises(ValueError) as raised:  # a real mismatch gets no such hint
        moba_attention(torch.randn(1, 4, 64, 8), torch.randn(1, 2, 32, 8), torch.randn(1, 2, 32, 8),
                                chunk_size=16, top_k=2)
    assert "look like" not in str(raised.value)
