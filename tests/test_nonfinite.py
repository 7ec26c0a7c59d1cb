"""Non-finite inputs: a NaN never wins a gate slot; a non-finite key shows up only where it is attended,
the same on every backend, decode kernel and context-parallel split as in the oracle."""


import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from flexmoba import MoBAKVCache, MobaSpec, moba_attention, moba_decode_attention, moba_selection
from flexmoba.context_parallel import local_moba_attention
from flexmoba.tuning import use_tuning

import oracle
from maxima_paths import MAXIMA_PATHS, maxima_path
from strategies import Problem, document_ids, random_inputs, run_backend


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

    # Queries that attend the NaN key (its own chunk, 20..23) are NaN; the rows before it neither attend
    # it nor gate on its chunk's mean (every backend and row: test_a_non_finite_key_makes_exactly_...).
    with torch.no_grad():
        sdpa = moba_attention(q, k, v, chunk_size=8, top_k=3, backend="sdpa")
        flex = moba_attention(q, k, v, chunk_size=8, top_k=3, backend="flex")
        clean_k = k.clone()
        clean_k[0, 0, 20] = 0.0
        clean = moba_attention(q, clean_k, v, chunk_size=8, top_k=3, backend="sdpa")
    for out in (sdpa, flex):
        assert torch.isnan(out[0, 0, 20:24]).all()
        torch.testing.assert_close(out[0, 0, :20], clean[0, 0, :20], atol=1e-5, rtol=1e-5)


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



# One fixed shape (GQA, a choice among 5 past chunks), so compiled flex compiles once per backend.
POISONED_SHAPE = (2, 4, 2, 48, 8)  # (B, H, H_kv, S, D)
NON_FINITE = [float("nan"), float("inf"), float("-inf")]


def poisoned(seed: int, entries, document_ids=None, granularity="token") -> Problem:
    """Random inputs of :data:`POISONED_SHAPE` (chunks of 8, top_k 3) whose keys hold the ``entries``:
    ``((b, kv head, position) or (b, kv head, position, coordinate), value)``."""
    q, k, v = random_inputs(seed, *POISONED_SHAPE)
    for where, value in entries:
        k[where] = value
    return Problem(q, k, v, 8, 3, granularity, document_ids)


@st.composite
def poisoned_keys(draw):
    """One or two non-finite key entries, each (batch row, KV head, position, one coordinate or the whole
    key, NaN / +inf / -inf); documents a quarter of the time, tiles of 4 a quarter."""
    B, _, H_kv, S, D = POISONED_SHAPE
    entries = []
    for _ in range(draw(st.integers(1, 2))):
        where = (draw(st.integers(0, B - 1)), draw(st.integers(0, H_kv - 1)), draw(st.integers(0, S - 1)))
        coordinate = draw(st.none() | st.integers(0, D - 1))
        entries.append((where if coordinate is None else (*where, coordinate), draw(st.sampled_from(NON_FINITE))))
    granularity = draw(st.sampled_from(["token", "token", "token", 4]))
    return poisoned(draw(st.integers(0, 2**31 - 1)), entries, draw(document_ids(B, S)), granularity)


def decoded(problem: Problem, backend: str) -> torch.Tensor:
    """Every row decoded from a :class:`MoBAKVCache`: all queries but the last in one call, then the last
    (decoding's one-query step) -> ``[B, H, S, D]``."""
    S = problem.q.shape[2]
    cache, outs = MoBAKVCache(problem.chunk_size), []
    for start, end in ((0, S - 1), (S - 1, S)):
        cache.update(problem.k[:, :, start:end], problem.v[:, :, start:end])
        outs.append(moba_decode_attention(problem.q[:, :, start:end], cache, top_k=problem.top_k, backend=backend))
    return torch.cat(outs, 2)


def unfused_gather():
    """Gather's path off CPU (plain tensor math), forced."""
    return use_tuning("cpu", gather_fused_kernel=False)


def split_in_ranks(problem: Problem, backend: str, ranks: int = 4) -> torch.Tensor:
    """Every rank's queries of a context-parallel split attended apart (one process), joined -> ``[B, H, S, D]``."""
    spec, L = MobaSpec(problem.chunk_size, problem.top_k, backend=backend), problem.q.shape[2] // ranks
    return torch.cat([local_moba_attention(problem.q[:, :, r * L:(r + 1) * L], problem.k, problem.v, spec, r * L,
                                           document_ids=problem.document_ids) for r in range(ranks)], 2)


def attend(path: str, problem: Problem) -> torch.Tensor:
    """``[B, H, S, D]`` by a prefill backend, ``"reference"``, ``"gather-unfused"``, a decode kernel
    (``"decode-<backend>"``) or context parallelism's ranks (``"ranks-<backend>"``)."""
    with torch.no_grad():
        if path.startswith("decode-"):
            return decoded(problem, path.removeprefix("decode-"))
        if path.startswith("ranks-"):
            return split_in_ranks(problem, path.removeprefix("ranks-"))
        if path == "gather-unfused":
            with unfused_gather():
                return run_backend("gather", problem.q, problem.k, problem.v, **problem.kwargs)
        return run_backend(path, problem.q, problem.k, problem.v, **problem.kwargs)


# Every prefill backend, gather's path off CPU, the reference, every decode kernel and every backend under
# context parallelism (4 ranks of 12 queries: own chunks cross rank boundaries). With non-finite keys compiled
# CPU flex runs gather: nothing compiles, unless that check is lost, but for the ranks whose keys are all finite.
PATHS = ("flex", "flex_union", "gather", "gather-unfused", "sdpa", "reference", "decode-gather", "decode-sdpa",
         "ranks-gather", "ranks-sdpa")


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("paths", [PATHS, pytest.param(("ranks-flex",), marks=pytest.mark.slow)],
                         ids=["every_backend", "ranks_flex"])
@example(poisoned(0, [((0, 0, 10), float("nan"))]))  # a NaN key
@example(poisoned(1, [((1, 1, 0, 2), float("-inf")), ((1, 0, 17), float("inf"))]))  # the first key's coordinate
# q[0, :2, 0, 5] > 0 (logits of -inf) in documents of one chunk each: no past chunk to attend instead
@example(poisoned(2, [((0, 0, 0, 5), float("-inf")), ((1, 1, 0), float("nan"))],
                  torch.tensor([0] * 8 + [1] * 8).repeat(2, 3)))
@example(poisoned(3, [((0, 0, 16, 4), float("-inf"))]))  # q[0, :2, 16, 4] > 0: query 16 attends its past chunks only
@given(poisoned_keys())
def test_a_non_finite_key_makes_exactly_the_oracles_rows_non_finite(paths, problem):
    """NaN, +inf or -inf in keys (one coordinate or whole keys): the non-finite output rows of every backend,
    decode kernel and context-parallel split are the oracle's (the rows with a NaN or +inf logit against a
    key they attend, or only -inf logits), and their finite rows equal the oracle's."""
    expected = oracle.attention(problem.q, problem.k, problem.v, **problem.attention_kwargs).float()
    finite = torch.isfinite(expected).all(-1)  # [B, H, S]
    for path in paths:
        if path.startswith("decode-") and problem.document_ids is not None:
            continue  # a cache holds one document per row
        if path.startswith(("decode-", "ranks-")) and problem.granularity != "token":
            continue  # decoding and context parallelism gate each token
        out = attend(path, problem)
        got = torch.isfinite(out).all(-1)
        assert torch.equal(got, finite), (f"{path}: non-finite rows {(~got).nonzero().tolist()}, "
                                          f"the oracle's {(~finite).nonzero().tolist()}; {problem}")
        torch.testing.assert_close(out[finite], expected[finite], atol=1e-5, rtol=1e-5)
