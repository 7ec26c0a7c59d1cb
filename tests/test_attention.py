"""MoBA attention: every backend against the oracle and against each other."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import oracle
from flexmoba import compiled_flex_attention, moba_attention, moba_block_mask, moba_reference, select_chunks
from flexmoba.gather import gather_moba_attention
from strategies import flex_problems, problems


def oracle_out(problem):
    kw = dict(problem.kwargs)
    return oracle.attention(problem.q, problem.k, problem.v, **kw)


@given(problems())
def test_sdpa_gather_and_reference_equal_oracle(problem):
    expected = oracle_out(problem)
    for got in (moba_attention(problem.q, problem.k, problem.v, backend="sdpa", **problem.kwargs),
                moba_attention(problem.q, problem.k, problem.v, backend="gather", **problem.kwargs),
                moba_reference(problem.q, problem.k, problem.v, **problem.kwargs)):
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


@given(problems(), st.integers(1, 9))
def test_gather_any_group_size_equals_oracle(problem, group_size):
    selection = select_chunks(problem.q, problem.k, **problem.kwargs)
    got = gather_moba_attention(problem.q, problem.k, problem.v, selection, group_size=group_size)
    torch.testing.assert_close(got.double(), oracle_out(problem), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@settings(max_examples=25)
@given(flex_problems())
def test_compiled_flex_equals_sdpa_and_oracle(problem):
    expected = oracle_out(problem)
    sdpa = moba_attention(problem.q, problem.k, problem.v, backend="sdpa", **problem.kwargs)
    flex = moba_attention(problem.q, problem.k, problem.v, backend="flex", **problem.kwargs)
    # Small blocks: a sparse table with skipped, partial and full blocks in the fused kernel.
    block_mask = moba_block_mask(problem.q, problem.k, block_size=16, **problem.kwargs)
    sparse = compiled_flex_attention()(problem.q, problem.k, problem.v, block_mask=block_mask,
                                       enable_gqa=problem.q.shape[1] != problem.k.shape[1])
    for got in (sdpa, flex, sparse):
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


@given(problems(token_only=True))
def test_future_keys_and_values_never_change_earlier_outputs(problem):
    S = problem.q.shape[2]
    cut = S // 2
    out = moba_attention(problem.q, problem.k, problem.v, backend="sdpa", **problem.kwargs)
    k2, v2 = problem.k.clone(), problem.v.clone()
    k2[:, :, cut:] = torch.randn_like(k2[:, :, cut:]) * 3
    v2[:, :, cut:] = torch.randn_like(v2[:, :, cut:]) * 3
    out2 = moba_attention(problem.q, k2, v2, backend="sdpa", **problem.kwargs)
    torch.testing.assert_close(out2[:, :, :cut], out[:, :, :cut], atol=0, rtol=0)


@given(problems())
def test_no_attention_across_documents(problem):
    if problem.document_ids is None:
        return
    out = moba_attention(problem.q, problem.k, problem.v, backend="sdpa", **problem.kwargs)
    first = problem.document_ids == problem.document_ids[:, :1]
    first &= torch.cumprod(first.long(), dim=1).bool()  # the first run only
    noise = torch.randn_like
    other = ~first[:, None, :, None]
    q2 = torch.where(other, noise(problem.q), problem.q)
    k2 = torch.where(other, noise(problem.k), problem.k)
    v2 = torch.where(other, noise(problem.v), problem.v)
    out2 = moba_attention(q2, k2, v2, backend="sdpa", **problem.kwargs)
    keep = first[:, None, :, None].expand_as(out)
    assert torch.equal(out2[keep], out[keep])


@given(problems())
def test_gqa_equals_repeated_kv(problem):
    group = problem.q.shape[1] // problem.k.shape[1]
    gqa = moba_attention(problem.q, problem.k, problem.v, backend="sdpa", **problem.kwargs)
    mha = moba_attention(problem.q, problem.k.repeat_interleave(group, 1), problem.v.repeat_interleave(group, 1),
                         backend="sdpa", **problem.kwargs)
    torch.testing.assert_close(gqa, mha, atol=1e-6, rtol=1e-6)


@given(problems(token_only=True))
def test_short_sequences_equal_causal_attention(problem):
    S = problem.q.shape[2]
    problem.top_k = max(problem.top_k, -(-S // problem.chunk_size))
    problem.document_ids = None
    got = moba_attention(problem.q, problem.k, problem.v, backend="sdpa", **problem.kwargs)
    expected = F.scaled_dot_product_attention(problem.q, problem.k, problem.v, is_causal=True,
                                              enable_gqa=problem.q.shape[1] != problem.k.shape[1])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@given(problems())
def test_differentiable_backends_have_reference_gradients(problem):
    grad_out = torch.randn_like(problem.q)

    def grads(fn, **kw):
        inputs = [t.clone().requires_grad_() for t in (problem.q, problem.k, problem.v)]
        (fn(*inputs, **problem.kwargs, **kw) * grad_out).sum().backward()
        return [t.grad for t in inputs]

    expected = grads(moba_reference)
    for backend in ("sdpa", "gather", "auto"):
        for got, want in zip(grads(moba_attention, backend=backend), expected):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_custom_scale_is_used():
    q, k, v = (torch.randn(1, 2, 40, 8) for _ in range(3))
    kw = dict(chunk_size=8, top_k=2)
    expected = oracle.attention(q, k, v, scale=0.3, **kw)
    torch.testing.assert_close(moba_attention(q, k, v, backend="sdpa", scale=0.3, **kw).double(), expected,
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(moba_reference(q, k, v, scale=0.3, **kw).double(), expected, atol=1e-5, rtol=1e-5)


def test_bfloat16_runs_and_stays_close_to_fp32():
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    kw = dict(chunk_size=16, top_k=2)
    out = moba_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), backend="sdpa", **kw)
    assert out.dtype == torch.bfloat16
    # Rounding may flip a near-tie in the gate, so compare against the oracle on the same bf16 inputs.
    expected = oracle.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), **kw)
    torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=3e-2)


@given(problems())
def test_gather_unfused_path_equals_reference_with_gradients(problem):
    """The path gather takes off CPU (plain tensor math), checked here by forcing it."""
    import flexmoba.gather as gather

    grad_out = torch.randn_like(problem.q)
    results = []
    for fused in (False, True):
        original = gather._fused_cpu
        gather._fused_cpu = lambda q, fused=fused: fused and original(q)
        try:
            inputs = [t.clone().requires_grad_() for t in (problem.q, problem.k, problem.v)]
            out = moba_attention(*inputs, backend="gather", **problem.kwargs)
            (out * grad_out).sum().backward()
            results.append([out] + [t.grad for t in inputs])
        finally:
            gather._fused_cpu = original
    inputs = [t.clone().requires_grad_() for t in (problem.q, problem.k, problem.v)]
    ref = moba_reference(*inputs, **problem.kwargs)
    (ref * grad_out).sum().backward()
    for result in results:
        for got, want in zip(result, [ref] + [t.grad for t in inputs]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
