"""Context parallelism: local queries at a global offset equal the same rows of single-process
attention, forward and backward, for every backend, with GQA and documents crossing rank
boundaries; checked against the single-process backends and against the brute-force oracle.

The slices run in one process (no process group: each rank's computation on the gathered keys);
the collectives themselves run in two gloo processes under torchrun (``context_parallel_worker.py``).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import registered_backend
import torch
import torch.nn.functional as F
from flex_standin import flex_standin

from flexmoba import MobaSpec, moba_attention, select_chunks, use_flex_attention
from flexmoba.context_parallel import (
    ContextParallel,
    attended_pairs_per_rank,
    local_causal_attention,
    local_moba_attention,
    sequence_slice,
    shard_sequence,
)
from flexmoba.gate import select_local_chunks
from flexmoba.pair_counts import keys_attended_moba

import oracle

TESTS = Path(__file__).resolve().parent


def inputs(B=2, H=4, H_kv=2, S=192, D=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, S, D, generator=gen) for h in (H, H_kv, H_kv))
    return q, k, v, torch.randn(B, H, S, D, generator=gen)


def documents_crossing(B: int, S: int, boundaries: list[int]) -> torch.Tensor:
    """``[B, S]`` ids whose documents straddle every rank boundary in ``boundaries`` (and differ per row)."""
    ids = torch.zeros(B, S, dtype=torch.long)
    for b in range(B):
        for i, cut in enumerate(sorted({max(1, x - 7 - 5 * b) for x in boundaries} | {S // 5 + b})):
            ids[b, cut:] = i + 1
    return ids


def split_run(attend, q, k, v, grad_out, n: int):
    """Every rank's slice attended apart, joined; the gradients of the join."""
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    L = q.shape[2] // n
    out = torch.cat([attend(q[:, :, r * L:(r + 1) * L], k, v, r * L) for r in range(n)], 2)
    return out, torch.autograd.grad((out * grad_out).sum(), (q, k, v))


def whole_run(attend, q, k, v, grad_out):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = attend(q, k, v)
    return out, torch.autograd.grad((out * grad_out).sum(), (q, k, v))


def assert_runs_equal(got, expected, tol=1e-5):
    torch.testing.assert_close(got[0], expected[0].to(got[0].dtype), atol=tol, rtol=tol)
    for g, e in zip(got[1], expected[1], strict=True):
        torch.testing.assert_close(g, e.to(g.dtype), atol=2 * tol, rtol=2 * tol)


@pytest.mark.parametrize("backend", ["gather", "sdpa", "flex"])
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("with_documents", [False, True])
def test_slices_equal_single_process_moba(backend, n, with_documents):
    """S = 192, chunk 32: with 3 ranks the boundaries (64, 128) fall on chunks, with 4 (48, 96, 144) inside them."""
    q, k, v, grad_out = inputs()
    S = q.shape[2]
    doc = documents_crossing(2, S, [S * r // n for r in range(1, n)]) if with_documents else None
    spec = MobaSpec(32, 3, backend=backend)
    whole = whole_run(lambda q, k, v: moba_attention(q, k, v, MobaSpec(32, 3, backend="gather"), document_ids=doc),
                      q, k, v, grad_out)
    with use_flex_attention(flex_standin):  # the flex path with gradients on CPU; unused by the others
        split = split_run(lambda q, k, v, o: local_moba_attention(q, k, v, spec, o, document_ids=doc),
                          q, k, v, grad_out, n)
    assert_runs_equal(split, whole)


@pytest.fixture
def user_backend():
    yield registered_backend.register()
    registered_backend.unregister()


@pytest.mark.parametrize("with_documents", [False, True])
def test_a_registered_backend_runs_on_slices_like_the_built_ins(user_backend, with_documents):
    """A backend registered with :func:`flexmoba.register_backend` (written in the test, from the
    protocol alone) gets the local queries at their offset: 4 ranks, boundaries inside chunks."""
    q, k, v, grad_out = inputs()
    S = q.shape[2]
    doc = documents_crossing(2, S, [S * r // 4 for r in range(1, 4)]) if with_documents else None
    spec = MobaSpec(32, 3, backend=user_backend)
    whole = whole_run(lambda q, k, v: moba_attention(q, k, v, MobaSpec(32, 3, backend="gather"), document_ids=doc),
                      q, k, v, grad_out)
    split = split_run(lambda q, k, v, o: local_moba_attention(q, k, v, spec, o, document_ids=doc), q, k, v, grad_out, 4)
    assert_runs_equal(split, whole)


def test_a_backend_that_declares_no_offsets_is_refused_by_name():
    name = registered_backend.register(context_parallel=False)
    try:
        q, k, v, _ = inputs(S=64)
        with pytest.raises(ValueError, match=f"^MobaSpec.backend='{name}' has no context-parallel path"):
            local_moba_attention(q[:, :, 32:], k, v, MobaSpec(16, 2, backend=name), 32)
        with pytest.raises(ValueError, match="^MobaSpec.backend='flex_union' has no context-parallel path"):
            local_moba_attention(q[:, :, 32:], k, v, MobaSpec(16, 2, backend="flex_union"), 32)
    finally:
        registered_backend.unregister()


def test_compiled_cpu_flex_with_its_sink_matches_too():
    q, k, v, _ = inputs(B=1, S=128)
    with torch.no_grad():
        whole = moba_attention(q, k, v, MobaSpec(32, 3, backend="gather"))
        split = torch.cat([local_moba_attention(q[:, :, o:o + 64], k, v, MobaSpec(32, 3, backend="flex"), o)
                           for o in (0, 64)], 2)
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("with_documents", [False, True])
def test_slices_equal_the_brute_force_oracle(with_documents):
    """The oracle shares no code with flexmoba: one softmax per query over the keys it attends."""
    q, k, v, grad_out = inputs(B=1, H=2, H_kv=1, S=96, D=8, seed=3)
    doc = documents_crossing(1, 96, [48]) if with_documents else None
    spec = MobaSpec(16, 3, backend="gather")
    split = split_run(lambda q, k, v, o: local_moba_attention(q, k, v, spec, o, document_ids=doc), q, k, v,
                      grad_out, 2)
    expected = whole_run(lambda q, k, v: oracle.attention(q, k, v, 16, 3, document_ids=doc), q, k, v, grad_out)
    assert_runs_equal(split, expected)


def test_documents_in_the_tests_really_cross_rank_boundaries():
    doc = documents_crossing(2, 192, [48, 96, 144])
    for cut in (48, 96, 144):
        assert (doc[:, cut - 1] == doc[:, cut]).all()  # the same document on both sides of the cut


@pytest.mark.parametrize("n", [2, 4])
def test_local_selection_is_the_slice_of_the_whole_selection(n):
    q, k, _, _ = inputs(S=256)
    doc = documents_crossing(2, 256, [256 * r // n for r in range(1, n)])
    spec = MobaSpec(32, 3)
    whole = select_chunks(q, k, spec, document_ids=doc)
    L = 256 // n
    for r in range(n):
        local = select_local_chunks(q[:, :, r * L:(r + 1) * L], k, spec, r * L, document_ids=doc)
        assert torch.equal(local.chunks, whole.chunks[:, :, r * L:(r + 1) * L])


def full_attention_with_documents(q, k, v, doc):
    """Causal attention inside documents (the ids here only grow, so equal ids are one document)."""
    mask = (doc[:, :, None] == doc[:, None, :]) & torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("with_documents", [False, True])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)])
def test_slices_equal_single_process_full_attention(n, with_documents, heads):
    q, k, v, grad_out = inputs(H=heads[0], H_kv=heads[1])
    doc = documents_crossing(2, 192, [192 * r // n for r in range(1, n)]) if with_documents else None
    if doc is None:
        whole = whole_run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                          q, k, v, grad_out)
    else:
        whole = whole_run(lambda q, k, v: full_attention_with_documents(q, k, v, doc), q, k, v, grad_out)
    split = split_run(lambda q, k, v, o: local_causal_attention(q, k, v, o, document_ids=doc), q, k, v, grad_out, n)
    assert_runs_equal(split, whole)


def test_full_attention_off_the_fused_path_goes_through_flex():
    q, k, v, grad_out = inputs(B=1)
    whole = whole_run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                      q, k, v, grad_out)
    with use_flex_attention(flex_standin):
        split = split_run(local_causal_attention, q, k, v, grad_out, 2)
    assert_runs_equal(split, whole)


def test_work_per_rank_sums_to_the_closed_form_and_is_balanced():
    q, k, _, _ = inputs(B=1, H=2, H_kv=1, S=1024, D=8)
    spec = MobaSpec(64, 3)
    for n in (1, 2, 4):
        work = attended_pairs_per_rank(q, k, spec, n)
        assert sum(work) == 2 * keys_attended_moba(1024, 64, 3)  # 2 heads
        assert max(work) / (sum(work) / n) < 1.1


# -- the group's slices, and bad input -------------------------------------------------


def test_slices_cover_the_sequence_once():
    assert [sequence_slice(12, r, 3) for r in range(3)] == [(0, 4), (4, 8), (8, 12)]
    x = torch.arange(24).view(1, 1, 12, 2)
    joined = torch.cat([shard_sequence(x, ContextParallel(r, 3)) for r in range(3)], 2)
    assert torch.equal(joined, x)


def test_sequence_length_not_divisible_by_the_group_is_refused_by_name():
    with pytest.raises(ValueError, match=r"^seq_len=130 must be divisible by context_parallel_size=4"):
        sequence_slice(130, 0, 4)
    with pytest.raises(ValueError, match="seq_len=13 must be divisible by context_parallel_size=2"):
        shard_sequence(torch.zeros(1, 1, 13, 2), ContextParallel(0, 2))


def test_bad_local_calls_are_refused_by_name():
    q, k, v, _ = inputs(S=64)
    with pytest.raises(ValueError, match="granularity must be 'token'"):
        local_moba_attention(q[:, :, 32:], k, v, MobaSpec(32, 2, granularity=16), 32)
    with pytest.raises(ValueError, match="reach past the 64 keys"):
        local_moba_attention(q[:, :, 32:], k, v, MobaSpec(32, 2), 40)
    with pytest.raises(ValueError, match="backend='flex_union' has no context-parallel path"):
        local_moba_attention(q[:, :, 32:], k, v, MobaSpec(32, 2, backend="flex_union"), 32)
    with pytest.raises(ValueError, match="document_ids must be"):
        local_moba_attention(q[:, :, 32:], k, v, MobaSpec(32, 2), 32, document_ids=torch.zeros(2, 32, dtype=torch.long))


# -- two processes ------------------------------------------------------------------------


@pytest.mark.slow
def test_two_gloo_processes_equal_one(tmp_path):
    """The all-gather and its backward over a real group: each rank's output and dq, dk, dv
    slices equal the single-process ones (MoBA with GQA and documents, through gather, sdpa and a
    backend registered by the test; full attention; the sliding window across the rank boundary)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(TESTS / "context_parallel_worker.py"), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for rank in (0, 1):
        report = (tmp_path / f"rank{rank}.txt").read_text()
        assert report.count("ok ") == 9 and "test-masked-softmax documents" in report, report
        assert "ok sliding window gqa" in report, report
