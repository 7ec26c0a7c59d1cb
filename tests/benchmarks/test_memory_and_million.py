"""The million-token benchmark's per-row reference and the memory benchmark's fit, on their own."""

import argparse

import pytest
import torch

from benchmarks.memory import PATHS, fit_linear, measure_here
from benchmarks.million import check_rows, reference_row, sampled_rows

import oracle

ARGS = argparse.Namespace(chunk_size=16, top_k=3, heads=2, kv_heads=1, head_dim=8, dtype="float32", profile="cpu",
                          flex_table_entries=0)


def small_problem(seed: int = 0, seq_len: int = 80):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, seq_len, 8, generator=gen)
    k, v = (torch.randn(1, 1, seq_len, 8, generator=gen) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("seed", range(3))
def test_the_per_row_reference_equals_the_oracle(seed):
    q, k, v = small_problem(seed)
    expected = oracle.attention(q, k, v, ARGS.chunk_size, ARGS.top_k)
    scale = q.shape[-1] ** -0.5
    for h in range(2):
        for t in range(q.shape[2]):
            got = reference_row(q[0, h, t], k[0, 0], v[0, 0], t, ARGS.chunk_size, ARGS.top_k, scale)
            torch.testing.assert_close(got, expected[0, h, t].float(), rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")  # the oracle's gate reads q as numbers
def test_row_checks_see_a_wrong_output_and_a_wrong_gradient():
    q, k, v = small_problem()
    rows = sampled_rows(q.shape[2], ARGS.chunk_size, 12, torch.Generator().manual_seed(1))
    right = oracle.attention(q, k, v, ARGS.chunk_size, ARGS.top_k)
    assert check_rows(q, k, v, right, rows, ARGS) < 1e-5
    assert check_rows(q, k, v, oracle.attention(q, k, v, ARGS.chunk_size, 2), rows, ARGS) > 1e-2  # a slot short
    upstream = torch.randn(q.shape)
    leaf = q.clone().requires_grad_(True)
    (oracle.attention(leaf, k, v, ARGS.chunk_size, ARGS.top_k) * upstream).sum().backward()
    q.grad = leaf.grad
    assert check_rows(q, k, v, right, rows, ARGS, upstream) < 1e-5
    q.grad *= 1.01
    assert check_rows(q, k, v, right, rows, ARGS, upstream) > 1e-4


def test_the_fit_is_exact_on_a_line_and_says_how_far_a_square_is():
    line = [{"seq_len": s, "peak_mib": 3.0 * s / 2**20 + 5} for s in (2**15, 2**16, 2**17)]
    fit_linear(line)
    assert [r.get("growth") for r in line] == [None, pytest.approx(line[1]["peak_mib"] / line[0]["peak_mib"]),
                                                pytest.approx(line[2]["peak_mib"] / line[1]["peak_mib"])]
    assert all(r["fit_error"] in ("+0%", "-0%") for r in line) and line[0]["bytes_per_token"] == pytest.approx(3.0)
    square = [{"seq_len": s, "peak_mib": (s / 2**15) ** 2} for s in (2**15, 2**16, 2**17, 2**18)]
    fit_linear(square)
    assert square[-1]["growth"] == pytest.approx(4.0) and abs(int(square[0]["fit_error"].rstrip("%"))) > 15


@pytest.mark.parametrize("path", PATHS)
def test_every_path_is_measured(path):
    row = measure_here(argparse.Namespace(**{**vars(ARGS), "chunk_size": 64}), path, 1024)
    assert row["path"] == path and row["seq_len"] == 1024 and row["peak_mib"] is not None and row["seconds"] > 0
    assert ("cache_mib" in row) == (path == "decode")
