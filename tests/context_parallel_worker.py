"""One rank of a 2-process gloo group (run by ``test_context_parallel.py`` under torchrun).

Every rank computes the single-process attention on the whole sequence, then its own slice
with :func:`flexmoba.context_parallel.context_parallel_attention` (full attention and the sliding window
likewise), and writes one line per case
to ``<out>/rank<r>.txt``: ``ok`` when the output and the dq, dk, dv slices agree within 1e-5.
"""

import sys
from pathlib import Path

import registered_backend
import torch
import torch.distributed as dist
import torch.nn.functional as F

from flexmoba import MobaSpec, moba_attention
from flexmoba.context_parallel import (
    ContextParallel,
    context_parallel_attention,
    context_parallel_full_attention,
    shard_sequence,
)
from flexmoba.sliding_window import context_parallel_sliding_window_attention, sliding_window_attention


def whole_and_sliced(attend_whole, attend_local, cp, heads=(4, 2), S=256):
    gen = torch.Generator().manual_seed(0)  # the same tensors on every rank
    q, k, v = (torch.randn(2, h, S, 16, generator=gen) for h in (heads[0], heads[1], heads[1]))
    grad_out = torch.randn(2, heads[0], S, 16, generator=gen)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = attend_whole(*leaves)
    expected = [shard_sequence(t, cp) for t in (out, *torch.autograd.grad((out * grad_out).sum(), leaves))]
    local = [shard_sequence(x, cp).clone().requires_grad_() for x in (q, k, v)]
    out = attend_local(*local)
    got = [out, *torch.autograd.grad((out * shard_sequence(grad_out, cp)).sum(), local)]
    return max(float((g - e).abs().max()) for g, e in zip(got, expected, strict=True))


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo")
    cp = ContextParallel.of()
    doc = torch.zeros(2, 256, dtype=torch.long)
    doc[0, 100:] = 1  # crosses the rank boundary at 128
    doc[1, 120:] = 1
    doc[1, 140:] = 2
    causal = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
    cases = {}
    for backend in ("gather", "sdpa", registered_backend.register()):
        spec = MobaSpec(32, 3, backend=backend)
        for name, ids in (("plain", None), ("documents", doc)):
            whole = lambda q, k, v, ids=ids: moba_attention(q, k, v, MobaSpec(32, 3, backend="gather"),  # noqa: E731
                                                             document_ids=ids)
            local = lambda q, k, v, ids=ids, spec=spec: context_parallel_attention(q, k, v, cp, spec,  # noqa: E731
                                                                                   document_ids=ids)
            cases[f"moba {backend} {name} gqa"] = whole_and_sliced(whole, local, cp)
    full = lambda q, k, v: context_parallel_full_attention(q, k, v, cp)  # noqa: E731
    cases["full gqa"] = whole_and_sliced(causal, full, cp)
    cases["full mha"] = whole_and_sliced(causal, full, cp, heads=(2, 2))
    # a window of 40 crosses the rank boundary at 128: rank 1's first queries read rank 0's last keys
    sliding = lambda q, k, v: sliding_window_attention(q, k, v, 40)  # noqa: E731
    sliced = lambda q, k, v: context_parallel_sliding_window_attention(q, k, v, cp, 40)  # noqa: E731
    cases["sliding window gqa"] = whole_and_sliced(sliding, sliced, cp)
    lines = [f"{'ok' if err <= 1e-5 else 'FAIL'} {name} max abs error {err:.2e}" for name, err in cases.items()]
    (out_dir / f"rank{cp.rank}.txt").write_text("\n".join(lines) + "\n")
    dist.destroy_process_group()
    if any(line.startswith("FAIL") for line in lines):
        sys.exit(1)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
