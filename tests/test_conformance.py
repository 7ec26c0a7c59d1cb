"""Agreement with the official MoBA implementation (moba_attn_varlen_naive) on its vectors."""

import pytest
import torch

from conformance_cases import load_cases
from flexmoba import moba_attention_varlen

CASES = load_cases()
CASE_IDS = [case["name"] for case in CASES]


def test_all_vectors_are_present(conformance_dir):
    assert len(CASES) == 44, f"expected 44 official cases in {conformance_dir}, found {len(CASES)}"


def run(case, backend, *inputs):
    return moba_attention_varlen(*inputs, case["cu_seqlens"], chunk_size=case["chunk_size"], top_k=case["top_k"],
                                 backend=backend)


@pytest.mark.parametrize("backend", ["sdpa", "gather"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_differentiable_backends_match_official_forward_and_gradients(case, backend):
    q, k, v = (case[name].clone().requires_grad_() for name in "qkv")
    out = run(case, backend, q, k, v)
    torch.testing.assert_close(out, case["out"], atol=1e-4, rtol=0)
    (out * case["grad_out"]).sum().backward()
    for name, tensor in zip("qkv", (q, k, v)):
        torch.testing.assert_close(tensor.grad, case["d" + name], atol=1e-4, rtol=0, msg=f"d{name}")


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_flex_forward_matches_official(case):
    with torch.no_grad():
        out = run(case, "flex", case["q"], case["k"], case["v"])
    torch.testing.assert_close(out, case["out"], atol=1e-4, rtol=0)
