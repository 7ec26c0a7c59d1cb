"""The backend table: every registered backend against the oracle and the official vectors,
the registration contract (attention and decoding), and which backend ``auto`` picks."""

from unittest import mock

import pytest
import registered_backend
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import flex_attention

from flexmoba import (
    MoBAKVCache,
    backend_names,
    moba_attention,
    moba_attention_varlen,
    moba_decode_attention,
    register_backend,
)
from flexmoba import backends as backend_table
from flexmoba.backends import registry, resolve_backend, resolve_decode_backend
from flexmoba.backends.checked import checked_attend
from flexmoba.backends.protocol import DecodeStep
from flexmoba.gate import Selection, select_local_chunks
from flexmoba.spec import MobaSpec
from flexmoba.tuning import tuning_for

import oracle
from conformance_cases import load_cases
from strategies import problems, random_inputs

BUILT_IN = ("flex", "flex_union", "gather", "sdpa")
CPU = tuning_for("cpu")
DECODE_GATHER_MAX_QUERIES = CPU.decode_gather_max_queries
FLEX_BACKENDS = ("flex", "flex_union")


def run(backend, q, k, v, **kwargs):
    """Flex backends run under no_grad and through eager flex: the mask_mod and the plan,
    without compiling a kernel per drawn shape (compiled kernels: fixed shapes, elsewhere)."""
    if backend in FLEX_BACKENDS:
        with torch.no_grad(), mock.patch("flexmoba.backends.flex.compiled._compiled_flex", flex_attention):
            return moba_attention(q, k, v, backend=backend, **kwargs)
    return moba_attention(q, k, v, backend=backend, **kwargs)


def test_the_built_in_backends_are_registered():
    assert set(BUILT_IN) <= set(backend_names())


@pytest.mark.parametrize("backend", backend_names())
@given(problem=problems())
def test_every_backend_equals_the_oracle(backend, problem):
    got = run(backend, problem.q, problem.k, problem.v, **problem.kwargs)
    expected = oracle.attention(problem.q, problem.k, problem.v, **problem.kwargs)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", backend_names())
def test_every_backend_uses_a_custom_scale(backend):
    q, k, v = random_inputs(7, 1, 4, 2, 45, 8)
    kw = dict(chunk_size=6, top_k=3)
    got = run(backend, q, k, v, scale=0.31, **kw)
    torch.testing.assert_close(got.double(), oracle.attention(q, k, v, scale=0.31, **kw), atol=1e-5, rtol=1e-5)


CASES = load_cases()


@pytest.mark.parametrize("backend", backend_names())
def test_every_backend_matches_the_official_vectors(conformance_dir, backend):
    assert CASES, f"no official vectors in {conformance_dir}"
    for case in CASES:
        q, k, v = (case[name] for name in "qkv")
        with torch.no_grad(), mock.patch("flexmoba.backends.flex.compiled._compiled_flex", flex_attention):
            out = moba_attention_varlen(q, k, v, case["cu_seqlens"], chunk_size=case["chunk_size"],
                                        top_k=case["top_k"], backend=backend)
        torch.testing.assert_close(out, case["out"], atol=1e-5, rtol=0, msg=case["name"])


@pytest.fixture
def scratch_backend():
    yield "scratch"
    registry._registered.pop("scratch", None)


def test_a_registered_backend_receives_the_selection_and_its_output_is_returned(scratch_backend):
    seen = {}

    def constant(q, k, v, selection, scale, *, query_start=0):
        seen.update(selection=selection, scale=scale)
        return torch.full_like(q, 3.0)

    register_backend(scratch_backend, constant)
    q, k, v = random_inputs(0, 1, 2, 1, 20, 4)
    out = moba_attention(q, k, v, chunk_size=4, top_k=2, backend=scratch_backend)
    assert torch.equal(out, torch.full_like(q, 3.0))
    assert isinstance(seen["selection"], Selection)
    assert seen["selection"].chunks.shape == (1, 2, 20, 5)
    assert seen["scale"] == pytest.approx(4 ** -0.5)


def test_registering_a_name_twice_needs_replace(scratch_backend):
    register_backend(scratch_backend, lambda q, k, v, selection, scale, query_start=0: q)
    with pytest.raises(ValueError, match="already registered"):
        register_backend(scratch_backend, lambda q, k, v, selection, scale, query_start=0: q)
    with pytest.raises(ValueError, match="already registered"):
        register_backend("gather", lambda q, k, v, selection, scale, query_start=0: q)
    register_backend(scratch_backend, lambda q, k, v, selection, scale, query_start=0: 2 * q, replace=True)
    q, k, v = random_inputs(0, 1, 1, 1, 8, 4)
    assert torch.equal(moba_attention(q, k, v, chunk_size=4, top_k=1, backend=scratch_backend), 2 * q)


def test_auto_is_reserved_and_unknown_names_are_refused():
    with pytest.raises(ValueError, match="reserved"):
        register_backend("auto", lambda q, k, v, selection, scale, query_start=0: q)
    with pytest.raises(TypeError, match="callable"):
        register_backend("nope", 3)
    q, k, v = random_inputs(0, 1, 1, 1, 8, 4)
    with pytest.raises(ValueError, match="backend must be one of"):
        moba_attention(q, k, v, chunk_size=4, top_k=1, backend="nope")


@pytest.mark.parametrize("wrong, problem", [
    (lambda q, v: q[..., :1], r"shape \[1, 2, 20, 1\], expected \[B, H, S, Dv\] = \[1, 2, 20, 4\]"),
    (lambda q, v: q.double(), "dtype torch.float64, expected q's torch.float32"),
    (lambda q, v: q.to("meta"), "device meta, expected q's cpu"),
    (lambda q, v: q.tolist(), "list, not a tensor"),
])
def test_a_registered_backend_s_output_of_another_shape_dtype_or_device_is_refused(scratch_backend, wrong, problem):
    register_backend(scratch_backend, lambda q, k, v, selection, scale, query_start=0: wrong(q, v))
    q, k, v = random_inputs(0, 1, 2, 1, 20, 4)
    with pytest.raises(RuntimeError, match=f"^backend '{scratch_backend}' \\(attention\\) returned {problem}"):
        moba_attention(q, k, v, chunk_size=4, top_k=2, backend=scratch_backend)


def test_debug_mode_compares_a_registered_backend_with_the_dense_math(scratch_backend):
    q, k, v = random_inputs(1, 2, 4, 2, 50, 8)
    documents = torch.tensor([[0] * 20 + [1] * 30, [0] * 50])
    expected = oracle.attention(q, k, v, chunk_size=6, top_k=3, document_ids=documents)

    def causal_only(q, k, v, selection, scale, *, query_start=0):  # a plausible kernel bug: the gate forgotten
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

    def all_nan(q, k, v, selection, scale, *, query_start=0):
        return torch.full_like(q, float("nan"))

    for kernel, row in ((causal_only, "query 20"), (all_nan, "query 0")):
        register_backend(scratch_backend, kernel, replace=True)  # checked for shape only: returned as it is
        assert moba_attention(q, k, v, chunk_size=6, top_k=3, document_ids=documents,
                              backend=scratch_backend).shape == q.shape
        register_backend(scratch_backend, kernel, replace=True, debug=True)
        with pytest.raises(RuntimeError, match=f"^backend '{scratch_backend}' differs from MoBA's dense math "
                                               f"\\(debug check\\) at batch row 0, head 0, {row}: "):
            moba_attention(q, k, v, chunk_size=6, top_k=3, document_ids=documents, backend=scratch_backend)
    register_backend(scratch_backend, registry.get_backend("gather"), replace=True, debug=True)
    got = moba_attention(q, k, v, chunk_size=6, top_k=3, document_ids=documents, backend=scratch_backend)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


@given(problem=problems())
def test_debug_mode_passes_a_correct_kernel_on_every_problem(problem):
    name = registered_backend.register(debug=True)
    try:
        got = moba_attention(problem.q, problem.k, problem.v, backend=name, **problem.kwargs)
    finally:
        registered_backend.unregister()
    expected = oracle.attention(problem.q, problem.k, problem.v, **problem.kwargs)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def off_in_the_last_row(q, k, v, selection, scale, *, query_start=0):
    out = registered_backend.attend(q, k, v, selection, scale, query_start=query_start)
    out[:, :, -1] += 1.0  # the last query row is always among the sampled ones
    return out


@given(problem=problems(), data=st.data())
def test_debug_mode_checks_queries_at_an_offset_as_context_parallelism_passes_them(problem, data):
    problem = problem.but(granularity="token")  # context parallelism's gate takes no tiles
    S = problem.q.shape[2]
    start = data.draw(st.integers(0, S - 1), label="query_start")
    q = problem.q[:, :, start:]
    selection = select_local_chunks(q, problem.k, MobaSpec(problem.chunk_size, problem.top_k), start,
                                    problem.document_ids)
    name = registered_backend.register(debug=True)
    try:
        got = checked_attend(name, registry.get_backend(name))(q, problem.k, problem.v, selection, 0.5,
                                                                query_start=start)
        register_backend(name, off_in_the_last_row, replace=True, debug=True)
        with pytest.raises(RuntimeError, match=f"query {S - start - 1}: "):
            checked_attend(name, registry.get_backend(name))(q, problem.k, problem.v, selection, 0.5,
                                                             query_start=start)
    finally:
        registered_backend.unregister()
    expected = oracle.attention(problem.q, problem.k, problem.v, scale=0.5, **problem.kwargs)[:, :, start:]
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def test_debug_mode_checks_a_registered_decode_kernel(scratch_backend):
    q, cache = filled_cache()
    register_backend(scratch_backend, registry.get_backend("gather"), decode=registry.get_decode_backend("gather"),
                     debug=True)
    expected = moba_decode_attention(q, cache, top_k=2, backend="gather")
    assert torch.equal(moba_decode_attention(q, cache, top_k=2, backend=scratch_backend), expected)
    register_backend(scratch_backend, registry.get_backend("gather"), decode=lambda step: step.q[..., :2],
                     replace=True)
    with pytest.raises(RuntimeError, match=f"^backend '{scratch_backend}' \\(decode\\) returned shape"):
        moba_decode_attention(q, cache, top_k=2, backend=scratch_backend)
    register_backend(scratch_backend, registry.get_backend("gather"), decode=lambda step: torch.zeros_like(step.q),
                     replace=True, debug=True)
    with pytest.raises(RuntimeError, match="differs from MoBA's dense math"):
        moba_decode_attention(q, cache, top_k=2, backend=scratch_backend)


def filled_cache(chunk_size=4, length=20, seed=0):
    """A MoBAKVCache holding ``length`` random keys and values ``[1, 1, length, 4]``; and q ``[1, 2, 2, 4]``."""
    q, k, v = random_inputs(seed, 1, 2, 1, length, 4)
    cache = MoBAKVCache(chunk_size)
    cache.update(k, v)
    return q[:, :, -2:], cache


def test_a_registered_decode_kernel_receives_the_gated_step_and_its_output_is_returned(scratch_backend):
    seen = {}

    def marker(step):
        seen["step"] = step
        return torch.full_like(step.q, 5.0)

    register_backend(scratch_backend, lambda q, k, v, selection, scale, query_start=0: q, decode=marker)
    q, cache = filled_cache()
    out = moba_decode_attention(q, cache, top_k=2, backend=scratch_backend, scale=0.25)
    assert torch.equal(out, torch.full_like(q, 5.0))
    step = seen["step"]
    assert isinstance(step, DecodeStep)
    assert step.scale == 0.25 and step.keys.shape == (1, 1, 20, 4) and step.q is q
    assert step.q_pos.tolist() == [18, 19] and step.own.tolist() == [[4, 4]]
    assert step.past.shape == step.valid.shape == (1, 2, 2, 1) and bool(step.valid.all())


def test_a_registered_backend_decodes_a_cache_to_the_oracle():
    """The test's own backend (written from the protocol alone) decodes token by token after a
    prefill, through the same dispatch as the built-ins: the rows of the oracle over the whole
    sequence."""
    name = registered_backend.register()
    try:
        q, k, v = random_inputs(3, 2, 4, 2, 70, 8)
        cache = MoBAKVCache(8)
        cache.update(k[:, :, :40], v[:, :, :40])
        outs = [moba_decode_attention(q[:, :, 36:40], cache, top_k=3, backend=name)]
        for t in range(40, 70):
            cache.update(k[:, :, t:t + 1], v[:, :, t:t + 1])
            outs.append(moba_decode_attention(q[:, :, t:t + 1], cache, top_k=3, backend=name))
    finally:
        registered_backend.unregister()
    expected = oracle.attention(q, k, v, chunk_size=8, top_k=3)[:, :, 36:]
    torch.testing.assert_close(torch.cat(outs, 2).double(), expected, atol=1e-6, rtol=1e-6)


def test_a_backend_without_decode_is_refused_by_name(scratch_backend):
    register_backend(scratch_backend, lambda q, k, v, selection, scale, query_start=0: q)
    q, cache = filled_cache()
    with pytest.raises(ValueError, match=f"^backend '{scratch_backend}' does not decode") as error:
        moba_decode_attention(q, cache, top_k=2, backend=scratch_backend)
    assert "\n" not in str(error.value)
    assert "'gather', 'sdpa'" in str(error.value)  # the backends that do decode


def test_the_built_in_decoders():
    for name in ("gather", "sdpa"):
        assert backend_table.get_decode_backend(name) is not None
    for name in FLEX_BACKENDS:
        with pytest.raises(ValueError, match=f"backend '{name}' does not decode"):
            backend_table.get_decode_backend(name)


@pytest.mark.parametrize("n_queries, n_chunks, top_k, expected", [
    (1, 3, 3, None),                                # own chunk index < top_k everywhere: dense
    (DECODE_GATHER_MAX_QUERIES + 1, 3, 3, None),
    (1, 4, 3, "gather"),                            # a chunk is skipped: MoBA gates
    (DECODE_GATHER_MAX_QUERIES, 4, 3, "gather"),
    (DECODE_GATHER_MAX_QUERIES + 1, 4, 3, "sdpa"),  # chunked prefill: one mask
])
def test_auto_decode_routing(n_queries, n_chunks, top_k, expected):
    assert resolve_decode_backend("auto", n_queries, n_chunks, top_k) == expected


def test_named_decode_backends_pass_through_at_every_length():
    for name in backend_names():
        assert resolve_decode_backend(name, 1, 1, 3) == name


def test_flex_refuses_gradients_on_cpu():
    q, k, v = (t.requires_grad_() for t in random_inputs(0, 1, 1, 1, 16, 4))
    for backend in FLEX_BACKENDS:
        with pytest.raises(ValueError, match="no CPU backward"):
            moba_attention(q, k, v, chunk_size=4, top_k=2, backend=backend)


def inputs(S, grad=False, device="cpu"):
    q, k, v = (torch.empty(1, 2, S, 8, device=device, requires_grad=grad) for _ in range(3))
    return q, k, v


LONG = CPU.auto_tile_flex_min_seq


SHORT = CPU.auto_gather_min_seq


@pytest.mark.parametrize("S, chunk_size, grad, granularity, expected", [
    (SHORT - 1, 64, True, "token", "sdpa"),      # short: the dense mask is fastest
    (SHORT - 1, 64, False, "token", "sdpa"),
    (SHORT, 64, True, "token", "gather"),        # long enough for the sparse path
    (SHORT, 64, False, "token", "gather"),
    (3 * SHORT, SHORT, True, "token", "sdpa"),   # every chunk selected: MoBA is causal attention
    (3 * SHORT + 1, SHORT, True, "token", "gather"),
    (LONG, 64, False, "token", "gather"),        # gather beats the regrouped flex plan on CPU
    (LONG, 64, True, 16, "gather"),              # flex has no CPU backward
    (LONG, 64, False, 16, "flex"),               # tiles: the union mask is exactly sparse
    (SHORT, 64, False, 16, "gather"),
])
def test_auto_routing_on_cpu(S, chunk_size, grad, granularity, expected):
    q, k, v = inputs(S, grad)
    assert resolve_backend(MobaSpec(chunk_size, 3, granularity), q, k, v) == expected


def test_auto_routing_without_grad_mode():
    q, k, v = inputs(LONG, grad=True)
    assert resolve_backend(MobaSpec(64, 3, 16), q, k, v) == "gather"
    with torch.no_grad():
        assert resolve_backend(MobaSpec(64, 3, 16), q, k, v) == "flex"


def test_auto_routing_off_cpu_is_flex():
    q, k, v = inputs(64, grad=True, device="meta")
    assert resolve_backend(MobaSpec(16, 2), q, k, v) == "flex"


def test_explicit_names_pass_through():
    q, k, v = inputs(64)
    for name in backend_names():
        assert resolve_backend(MobaSpec(16, 2, backend=name), q, k, v) == name


def test_a_prebuilt_layout_gives_the_same_attention_and_is_checked():
    from flexmoba.layout import chunk_layout

    q, k, v = random_inputs(2, 2, 2, 1, 40, 4)
    ids = torch.tensor([[0] * 13 + [1] * 27, [5] * 40])
    layout = chunk_layout(2, 40, 6, q.device, ids)
    kw = dict(chunk_size=6, top_k=3, document_ids=ids, backend="gather")
    assert torch.equal(moba_attention(q, k, v, layout=layout, **kw), moba_attention(q, k, v, **kw))
    with pytest.raises(ValueError, match="chunk_size"):
        moba_attention(q, k, v, layout=chunk_layout(2, 40, 5, q.device, ids), **kw)
    with pytest.raises(ValueError, match="document_ids"):
        moba_attention(q, k, v, layout=chunk_layout(2, 40, 6, q.device), **kw)


def test_one_attention_call_checks_its_inputs_once_and_builds_its_spec_once(monkeypatch):
    from flexmoba import spec as spec_module
    from flexmoba import validation

    counts = {"q and k checked": 0, "specs built": 0}
    check_qk, post_init = validation.check_qk, spec_module.MobaSpec.__post_init__

    def counted_check_qk(*args):
        counts["q and k checked"] += 1
        return check_qk(*args)

    def counted_post_init(self):
        counts["specs built"] += 1
        return post_init(self)

    monkeypatch.setattr(validation, "check_qk", counted_check_qk)
    monkeypatch.setattr(spec_module.MobaSpec, "__post_init__", counted_post_init)
    q = torch.randn(1, 2, 64, 8)
    for backend in ("gather", "sdpa", "auto"):
        counts.update({"q and k checked": 0, "specs built": 0})
        moba_attention(q, q, q, chunk_size=16, top_k=2, backend=backend)
        assert counts == {"q and k checked": 1, "specs built": 1}, backend
    spec = MobaSpec(16, 2)
    counts.update({"q and k checked": 0, "specs built": 0})
    moba_attention(q, q, q, spec, document_ids=torch.zeros(1, 64, dtype=torch.long))
    assert counts == {"q and k checked": 1, "specs built": 0}
