"""MoBA attention: every backend against the oracle and against each other."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from flexmoba import compiled_flex_attention, moba_attention, moba_block_mask, moba_reference, select_chunks
from flexmoba.backends.gather.kernel import gather_moba_attention

import oracle
from strategies import flex_problems, problems, run_backend, seeded_randn, with_examples

# Every backend that runs on CPU with gradients; "reference" is moba_reference.
BACKENDS = ["sdpa", "gather", "reference"]




def grad_tolerance(problem):
    """fp32 gradients of two exact implementations drift apart with sharper softmaxes:
    up to 4e-6 at the default scale, 1.3e-5 at scale 1 (measured over ~2000 draws)."""
    return 1e-5 if problem.scale is None else 2e-5


def oracle_out(problem):
    return oracle.attention(problem.q, problem.k, problem.v, **problem.attention_kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
@with_examples()
@given(problems())
def test_backend_equals_oracle(backend, problem):
    got = run_backend(backend, problem.q, problem.k, problem.v, **problem.attention_kwargs)
    torch.testing.assert_close(got.double(), oracle_out(problem), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@with_examples("custom_scale", "all_at_once")
@given(problems(scaled=True))
def test_custom_scale_equals_oracle(backend, problem):
    got = run_backend(backend, problem.q, problem.k, problem.v, **problem.attention_kwargs)
    torch.testing.assert_close(got.double(), oracle_out(problem), atol=1e-5, rtol=1e-5)


@given(problems(), st.integers(1, 9))
def test_gather_any_query_block_equals_oracle(problem, query_block):
    selection = select_chunks(problem.q, problem.k, **problem.kwargs)
    got = gather_moba_attention(problem.q, problem.k, problem.v, selection, problem.scale, query_block=query_block)
    torch.testing.assert_close(got.double(), oracle_out(problem), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@settings(max_examples=25)
@given(flex_problems())
def test_compiled_flex_equals_sdpa_and_oracle(problem):
    expected = oracle_out(problem)
    sdpa = moba_attention(problem.q, problem.k, problem.v, backend="sdpa", **problem.attention_kwargs)
    flex = moba_attention(problem.q, problem.k, problem.v, backend="flex", **problem.attention_kwargs)
    # Small blocks: a sparse table with skipped, partial and full blocks in the fused kernel.
    block_mask = moba_block_mask(problem.q, problem.k, block_size=16, **problem.kwargs)
    sparse = compiled_flex_attention()(problem.q, problem.k, problem.v, block_mask=block_mask, scale=problem.scale,
                                       enable_gqa=problem.q.shape[1] != problem.k.shape[1])
    for got in (sdpa, flex, sparse):
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


@given(problems(token_only=True))
def test_future_keys_and_values_never_change_earlier_outputs(problem):
    S = problem.q.shape[2]
    cut = S // 2
    out = moba_attention(problem.q, problem.k, problem.v, backend="sdpa", **problem.kwargs)
    k2, v2 = problem.k.clone(), problem.v.clone()
    k2[:, :, cut:] = seeded_randn(k2[:, :, cut:]) * 3
    v2[:, :, cut:] = seeded_randn(v2[:, :, cut:]) * 3 + 1
    out2 = moba_attention(problem.q, k2, v2, backend="sdpa", **problem.kwargs)
    torch.testing.assert_close(out2[:, :, :cut], out[:, :, :cut], atol=0, rtol=0)


def runs(problem, b):
    """(start, end) of each document of row b (the oracle's runs)."""
    ids = None if problem.document_ids is None else problem.document_ids[b]
    return oracle.documents(ids, problem.q.shape[2])


def assert_documents_isolated(backend, problem):
    """In each row take the longest document; noise everywhere else must not change its
    outputs, and noise inside it must not change anything else. Earlier documents with the
    same id, later ones, one-token ones: all are "everywhere else"."""
    B, _, S, _ = problem.q.shape
    inside = torch.zeros(B, S, dtype=torch.bool)
    for b in range(B):
        start, end = max(runs(problem, b), key=lambda run: run[1] - run[0])
        inside[b, start:end] = True
    kw = problem.attention_kwargs
    out = run_backend(backend, problem.q, problem.k, problem.v, **kw)
    gen = torch.Generator().manual_seed(0)
    for region, name in ((~inside, "other documents"), (inside, "the longest document")):
        where = region[:, None, :, None]
        q, k, v = (torch.where(where, 3 * torch.randn(x.shape, generator=gen), x)
                   for x in (problem.q, problem.k, problem.v))
        noisy = run_backend(backend, q, k, v, **kw)
        keep = ~region[:, None, :, None].expand_as(out)
        assert torch.equal(noisy[keep], out[keep]), f"noise in {name} leaked out of it: {problem}"


@pytest.mark.parametrize("backend", BACKENDS)
@with_examples("reused_ids", "one_token_documents", "all_at_once")
@given(problems())
def test_documents_are_isolated(backend, problem):
    if problem.document_ids is None or all(len(runs(problem, b)) == 1 for b in range(problem.q.shape[0])):
        return
    assert_documents_isolated(backend, problem)


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
    problem = problem.but(top_k=max(problem.top_k, -(-S // problem.chunk_size)), document_ids=None)
    got = moba_attention(problem.q, problem.k, problem.v, backend="sdpa", **problem.kwargs)
    expected = F.scaled_dot_product_attention(problem.q, problem.k, problem.v, is_causal=True,
                                              enable_gqa=problem.q.shape[1] != problem.k.shape[1])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@given(problems())
def test_differentiable_backends_have_reference_gradients(problem):
    grad_out = seeded_randn(problem.q)

    def grads(fn, **kw):
        inputs = [t.clone().requires_grad_() for t in (problem.q, problem.k, problem.v)]
        (fn(*inputs, **problem.attention_kwargs, **kw) * grad_out).sum().backward()
        return [t.grad for t in inputs]

    expected = grads(moba_reference)
    tol = grad_tolerance(problem)
    for backend in ("sdpa", "gather", "auto"):
        for got, want in zip(grads(moba_attention, backend=backend), expected, strict=True):
            torch.testing.assert_close(got, want, atol=tol, rtol=1e-5)


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
    from flexmoba.tuning import use_tuning

    grad_out = seeded_randn(problem.q)
    results = []
    for fused in (False, True):
        with use_tuning("cpu", gather_fused_kernel=fused):
            inputs = [t.clone().requires_grad_() for t in (problem.q, problem.k, problem.v)]
            out = moba_attention(*inputs, backend="gather", **problem.attention_kwargs)
            (out * grad_out).sum().backward()
            results.append([out] + [t.grad for t in inputs])
    inputs = [t.clone().requires_grad_() for t in (problem.q, problem.k, problem.v)]
    ref = moba_reference(*inputs, **problem.attention_kwargs)
    (ref * grad_out).sum().backward()
    tol = grad_tolerance(problem)
    for result in results:
        for got, want in zip(result, [ref] + [t.grad for t in inputs], strict=True):
            torch.testing.assert_close(got, want, atol=tol, rtol=1e-5)
