"""What documents cost exact MoBA: the ``gather`` backend with ``document_ids`` against the chunk grid.

The same random q, k, v ``[B, H, S, D]`` (GQA: ``H_kv`` KV heads) and spec attend twice through
``gather``: without documents (the chunk grid) and with ``--documents`` equal documents per row
(chunks restart at each; a document's last chunk may be shorter). Forward and forward+backward;
each pair is timed in turns in one process, the gate included. "docs / grid" above 1 means
the documents path costs more; it attends slightly fewer pairs (nothing crosses a boundary).
The defaults are the default model's attention (H 4/2, D 32, chunk 128, top-3) at 8K tokens a call.

    flexmoba bench documents [--seq_lens 1024 8192] [--documents 3] [--repeats 7]
"""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.common import (
    DEFAULT_OUT,
    OUT_HELP,
    OneLineArgumentParser,
    finish_report,
    interleaved_median_seconds,
    print_row,
    settle_malloc,
    timing_repeats,
)
from flexmoba import MobaSpec, moba_attention

COLUMNS = [
    ("seq_len", "S"), ("batch", "B"), ("documents", "documents"),
    ("grid_fwd_ms", "grid fwd (ms)"), ("docs_fwd_ms", "docs fwd (ms)"), ("fwd_ratio", "docs / grid fwd"),
    ("grid_fb_ms", "grid fwd+bwd (ms)"), ("docs_fb_ms", "docs fwd+bwd (ms)"), ("fb_ratio", "docs / grid fwd+bwd"),
]


def equal_documents(batch: int, seq_len: int, documents: int) -> torch.Tensor:
    """``[B, S]`` ids of ``documents`` equal runs per row (the last takes the remainder)."""
    return (torch.arange(seq_len) * documents // seq_len).expand(batch, seq_len)


def measure(seq_len: int, args) -> dict:
    batch = max(1, args.tokens // seq_len)
    gen = torch.Generator().manual_seed(seq_len)
    q = torch.randn(batch, args.heads, seq_len, args.head_dim, generator=gen).requires_grad_()
    k, v = (torch.randn(batch, args.kv_heads, seq_len, args.head_dim, generator=gen).requires_grad_()
            for _ in range(2))
    grad = torch.randn(q.shape, generator=gen)
    spec = MobaSpec(chunk_size=args.chunk_size, top_k=args.top_k, backend="gather")
    documents = equal_documents(batch, seq_len, args.documents)

    def forward(ids):
        def run():
            with torch.no_grad():
                moba_attention(q, k, v, spec, document_ids=ids)
        return run

    def forward_backward(ids):
        def run():
            q.grad = k.grad = v.grad = None
            moba_attention(q, k, v, spec, document_ids=ids).backward(grad)
        return run

    grid_f, docs_f, grid_fb, docs_fb = interleaved_median_seconds(
        [forward(None), forward(documents), forward_backward(None), forward_backward(documents)],
        repeats=args.repeats, warmup=1)
    return {"seq_len": seq_len, "batch": batch, "documents": args.documents,
            "grid_fwd_ms": grid_f * 1e3, "docs_fwd_ms": docs_f * 1e3, "fwd_ratio": docs_f / grid_f,
            "grid_fb_ms": grid_fb * 1e3, "docs_fb_ms": docs_fb * 1e3, "fb_ratio": docs_fb / grid_fb}


def parse_args(argv=None):
    p = OneLineArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq_lens", type=int, nargs="+", default=[1024, 8192], help="sequence lengths S")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per call: B = max(1, tokens // S)")
    p.add_argument("--documents", type=int, default=3, help="equal documents per row")
    p.add_argument("--heads", type=int, default=4, help="H")
    p.add_argument("--kv_heads", type=int, default=2, help="H_kv")
    p.add_argument("--head_dim", type=int, default=32, help="D")
    p.add_argument("--chunk_size", type=int, default=128, help="MoBA chunk size")
    p.add_argument("--top_k", type=int, default=3, help="MoBA top-k")
    p.add_argument("--repeats", type=timing_repeats, default=7, help="timed calls per measurement (median)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=OUT_HELP)
    args = p.parse_args(argv)
    if args.documents < 1:
        p.error(f"--documents must be >= 1, got {args.documents}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    settle_malloc()
    rows = []
    for seq_len in args.seq_lens:
        rows.append(measure(seq_len, args))
        print_row(rows[-1], COLUMNS)
    finish_report("documents_cpu", rows, COLUMNS, args.out)


if __name__ == "__main__":
    main()
