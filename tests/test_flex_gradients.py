"""The GPU training path on CPU: flexmoba's flex calls pointed at the differentiable stand-in.

``use_flex_attention(flex_standin)`` is the seam: the regrouped plan then runs without the
sink (flex's own log-sum-exp, as on GPU) and gradients flow through flex's output, its LSE
and the log-sum-exp merge. Forward outputs are held to the oracle, gradients to
``moba_reference``'s (plain autograd through the dense mask).
"""

import pytest
import torch
from flex_standin import flex_standin
from hypothesis import given, settings
from torch.nn.attention.flex_attention import flex_attention

from flexmoba import moba_attention, moba_flex_plan, moba_reference, use_flex_attention
from flexmoba.backends.flex.compiled import active_flex_attention, custom_flex_attention
from flexmoba.tuning import use_tuning

import oracle
from strategies import Problem, make_problem, problems, runs_to_ids, seeded_randn

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 8  # small blocks: a plan of several query and key blocks at these lengths

CASES = {
    "mha": make_problem(1, 2, 2, 40, 8, chunk_size=8, top_k=2, seed=1),
    "gqa": make_problem(2, 4, 2, 48, 8, chunk_size=6, top_k=3, seed=2),
    "documents": make_problem(2, 2, 1, 36, 4, chunk_size=4, top_k=2, seed=3, document_ids=[
        runs_to_ids([(7, 12), (3, 1), (7, 17), (3, 6)]), runs_to_ids([(0, 20), (1, 16)])]),
    "top_k_1": make_problem(1, 2, 1, 32, 8, chunk_size=8, top_k=1, seed=4),
    "top_k_beyond_chunks": make_problem(1, 2, 1, 30, 8, chunk_size=8, top_k=6, seed=5),
    "ragged": make_problem(1, 3, 1, 43, 8, chunk_size=5, top_k=3, seed=6),  # 43: off the block and chunk grid
    "custom_scale": make_problem(1, 4, 2, 40, 8, chunk_size=4, top_k=3, scale=0.3, seed=7, document_ids=[
        runs_to_ids([(1, 3), (2, 30), (1, 7)])]),
}


def grad_tolerance(problem):
    """As in test_attention: fp32 gradients of two exact implementations drift by up to
    4e-6 at the default scale, 1.3e-5 at scale 1."""
    return 1e-5 if problem.scale is None else 2e-5


def outputs_and_grads(fn, problem: Problem):
    """``[out, dq, dk, dv]`` of ``fn(q, k, v)`` against fixed output gradients."""
    inputs = [t.clone().requires_grad_() for t in (problem.q, problem.k, problem.v)]
    out = fn(*inputs)
    (out * seeded_randn(problem.q)).sum().backward()
    return [out.detach()] + [t.grad for t in inputs]


def check_against_the_reference(fn, problem: Problem):
    with use_flex_attention(flex_standin):
        got = outputs_and_grads(fn, problem)
    want = outputs_and_grads(lambda q, k, v: moba_reference(q, k, v, **problem.attention_kwargs), problem)
    expected_out = oracle.attention(problem.q, problem.k, problem.v, **problem.attention_kwargs)
    torch.testing.assert_close(got[0].double(), expected_out, atol=1e-5, rtol=1e-5)
    tol = grad_tolerance(problem)
    for name, g, w in zip(("dq", "dk", "dv"), got[1:], want[1:], strict=True):
        torch.testing.assert_close(g, w, atol=tol, rtol=tol, msg=lambda m, name=name: f"{name}: {m}")


def plan_attention(problem: Problem):
    def run(q, k, v):
        plan = moba_flex_plan(q, k, chunk_size=problem.chunk_size, top_k=problem.top_k,
                              document_ids=problem.document_ids, block_size=BLOCK)
        assert not plan.sink, "with a flex that returns the LSE the plan runs without the sink"
        return plan.attention(q, k, v, scale=problem.scale)
    return run


@pytest.mark.parametrize("name", CASES)
def test_plan_without_the_sink_has_reference_gradients(name):
    check_against_the_reference(plan_attention(CASES[name]), CASES[name])


@settings(max_examples=15)
@given(problems(max_seq_len=40, token_only=True))
def test_plan_without_the_sink_has_reference_gradients_on_drawn_problems(problem):
    check_against_the_reference(plan_attention(problem), problem)


@pytest.mark.parametrize("name", ["mha", "gqa", "documents", "ragged", "top_k_1"])
def test_plan_in_pieces_has_reference_gradients(name):
    """One block of virtual rows per piece: the forward keeps no virtual rows, the backward runs each
    piece's flex call again (flexmoba.backends.flex.recompute)."""
    with use_tuning("cpu", flex_table_entries=1):
        check_against_the_reference(plan_attention(CASES[name]), CASES[name])


def test_plan_in_pieces_runs_each_piece_s_flex_call_again_in_the_backward_only_with_gradients():
    problem = CASES["gqa"]
    calls = []

    def counting(*args, **kwargs):
        calls.append(kwargs["block_mask"].seq_lengths[0])
        return flex_standin(*args, **kwargs)

    with use_tuning("cpu", flex_table_entries=1), use_flex_attention(counting):
        plan = moba_flex_plan(problem.q, problem.k, chunk_size=problem.chunk_size, top_k=problem.top_k,
                              block_size=BLOCK)
        assert plan.pieces == plan.virtual_len // BLOCK > 1
        with torch.no_grad():
            plan.attention(problem.q, problem.k, problem.v)
        assert calls == [BLOCK] * plan.pieces
        calls.clear()
        outputs_and_grads(lambda q, k, v: plan.attention(q, k, v), problem)
        assert calls == [BLOCK] * (2 * plan.pieces)


def saved_shapes(plan, q, k, v):
    """Shapes of the tensors autograd saves for the backward of ``plan.attention``."""
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        plan.attention(*(t.clone().requires_grad_() for t in (q, k, v)))
    return shapes


def test_plan_in_pieces_keeps_no_virtual_rows_for_the_backward():
    """Several pieces: the backward keeps q, k, v, the output and each query's log-sum-exp; one piece
    keeps the virtual queries, outputs and log-sum-exps ([.., L] or [.., L, D])."""
    problem = CASES["gqa"]
    q, k, v = problem.q, problem.k, problem.v
    with use_flex_attention(flex_standin):
        for entries, keeps_virtual_rows in ((1, False), (2**30, True)):
            with use_tuning("cpu", flex_table_entries=entries):
                plan = moba_flex_plan(q, k, chunk_size=problem.chunk_size, top_k=problem.top_k, block_size=BLOCK)
            virtual = [s for s in saved_shapes(plan, q, k, v) if plan.virtual_len in s]
            assert bool(virtual) == keeps_virtual_rows, (plan.pieces, virtual)


@pytest.mark.parametrize("backend", ["flex", "flex_union"])
@pytest.mark.parametrize("name", ["gqa", "documents", "ragged", "custom_scale"])
def test_moba_attention_flex_backends_train(backend, name):
    problem = CASES[name]
    check_against_the_reference(
        lambda q, k, v: moba_attention(q, k, v, backend=backend, **problem.attention_kwargs), problem)


@pytest.mark.parametrize("backend", ["flex", "flex_union"])
def test_tile_granularity_through_the_union_mask_trains(backend):
    problem = make_problem(2, 4, 2, 44, 8, chunk_size=6, top_k=3, granularity=3, scale=0.7, seed=8,
                           document_ids=[runs_to_ids([(2, 1), (9, 30), (2, 13)]), [0] * 44])
    check_against_the_reference(
        lambda q, k, v: moba_attention(q, k, v, backend=backend, **problem.attention_kwargs), problem)


def test_the_seam_lifts_the_cpu_gradient_refusal_only_inside_and_nests():
    problem = CASES["mha"]
    q, k, v = (t.clone().requires_grad_() for t in (problem.q, problem.k, problem.v))
    attend = lambda: moba_attention(q, k, v, chunk_size=8, top_k=2, backend="flex")  # noqa: E731
    with pytest.raises(ValueError, match="no CPU backward"):
        attend()
    assert moba_flex_plan(q, k, chunk_size=8, top_k=2).sink
    with use_flex_attention(flex_standin):
        assert active_flex_attention() is flex_standin
        assert not moba_flex_plan(q, k, chunk_size=8, top_k=2).sink
        attend().sum().backward()
        assert q.grad is not None and k.grad is not None and v.grad is not None
        with use_flex_attention(flex_attention):
            assert active_flex_attention() is flex_attention
        assert active_flex_attention() is flex_standin
    assert custom_flex_attention() is None
    with pytest.raises(ValueError, match="no CPU backward"):
        attend()


def test_use_flex_attention_wants_a_callable():
    with pytest.raises(TypeError, match="flex must be callable"):
        with use_flex_attention("flex"):
            pass


def test_the_flex_backend_asks_flex_for_its_lse_and_adds_no_sink_key():
    """The GPU path: one flex call over the S real keys, no score_mod, the LSE requested."""
    problem = CASES["gqa"]
    calls = []

    def recording(q, k, v, **kwargs):
        calls.append((k.shape[2], kwargs.get("score_mod"), kwargs.get("return_aux")))
        return flex_standin(q, k, v, **kwargs)

    with use_flex_attention(recording):
        moba_attention(problem.q, problem.k, problem.v, backend="flex", **problem.attention_kwargs)
    [(kv_len, score_mod, aux)] = calls
    assert kv_len == problem.k.shape[2] and score_mod is None and aux.lse
