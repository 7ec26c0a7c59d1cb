"""Brute-force MoBA, one query at a time, written from the paper's description.

It shares no code with flexmoba: documents are found by walking the ids, chunks by
slicing, the top-k by sorting a Python list. Slow and obvious on purpose.
"""

from __future__ import annotations

import torch


def documents(document_ids, seq_len):
    """List of (start, end) runs of equal ids; one document when ids is None."""
    if document_ids is None:
        return [(0, seq_len)]
    ids = document_ids.tolist()
    runs, start = [], 0
    for t in range(1, seq_len + 1):
        if t == seq_len or ids[t] != ids[t - 1]:
            runs.append((start, t))
            start = t
    return runs


def chunk_mean(keys, round_to_key_dtype=True):
    """Mean of ``keys: [n, D]`` as the official gate takes it: computed exactly, rounded to
    the keys' dtype (a no-op in fp32, visible in bf16 and fp16), then used in fp32."""
    mean = keys.double().mean(0)
    return (mean.to(keys.dtype) if round_to_key_dtype else mean).float()


def past_scores(q, k, chunk_size, granularity="token", document_ids=None, round_means=True):
    """Per (b, h, t): ``(bounds, own, scores)``: the (start, end) of every chunk of t's
    document, the index of t's own chunk, and the gate score of each past chunk j < own.

    A score is the fp32 dot of the query (with tiles: the tile's mean query) with the
    chunk's :func:`chunk_mean`; ``round_means=False`` skips the rounding to k's dtype (to
    show that a test can tell the difference).
    """
    B, H, S, _ = q.shape
    group = H // k.shape[1]
    out = {}
    for b in range(B):
        for doc_start, doc_end in documents(None if document_ids is None else document_ids[b], S):
            starts = list(range(doc_start, doc_end, chunk_size))
            bounds = [(s, min(s + chunk_size, doc_end)) for s in starts]
            for h in range(H):
                means = [chunk_mean(k[b, h // group, s:e], round_means) for s, e in bounds]
                for t in range(doc_start, doc_end):
                    own = (t - doc_start) // chunk_size
                    if granularity == "token":
                        query = q[b, h, t].float()
                    else:
                        tile_start = doc_start + (t - doc_start) // granularity * granularity
                        query = q[b, h, tile_start:min(tile_start + granularity, doc_end)].float().mean(0)
                    out[b, h, t] = bounds, own, [float(query @ means[j]) for j in range(own)]
    return out


def selected_chunks(q, k, chunk_size, top_k, granularity="token", document_ids=None, round_means=True):
    """Per (b, h, t): sorted list of (chunk_start, chunk_end) key ranges attended, own chunk cut at t.

    A past chunk scoring NaN or -inf (a non-finite key in it) is never selected, flexmoba's rule
    (the official code's ``topk`` would rank a NaN first)."""
    out = {}
    for (b, h, t), (bounds, own, scores) in past_scores(q, k, chunk_size, granularity, document_ids,
                                                        round_means).items():
        eligible = [(score, j) for j, score in enumerate(scores) if score == score and score != float("-inf")]
        scored = sorted(eligible, reverse=True)
        chosen = sorted(j for _, j in scored[: top_k - 1]) + [own]
        out[b, h, t] = [(bounds[j][0], bounds[j][1] if j < own else t + 1) for j in chosen]
    return out


def dense_mask(q, k, chunk_size, top_k, granularity="token", document_ids=None, round_means=True):
    """``[B, H, S, S]`` bool built from :func:`selected_chunks`."""
    B, H, S, _ = q.shape
    mask = torch.zeros(B, H, S, S, dtype=torch.bool)
    for (b, h, t), ranges in selected_chunks(q, k, chunk_size, top_k, granularity, document_ids,
                                             round_means).items():
        for s, e in ranges:
            mask[b, h, t, s:e] = True
    return mask


def attention(q, k, v, chunk_size, top_k, granularity="token", document_ids=None, scale=None):
    """``[B, H, S, D]`` output, one softmax per query over its attended keys, in float64."""
    B, H, S, D = q.shape
    group = H // k.shape[1]
    scale = D ** -0.5 if scale is None else scale
    out = torch.zeros(B, H, S, v.shape[-1], dtype=torch.float64)
    for (b, h, t), ranges in selected_chunks(q, k, chunk_size, top_k, granularity, document_ids).items():
        keys = torch.cat([torch.arange(s, e) for s, e in ranges])
        logits = k[b, h // group, keys].double() @ q[b, h, t].double() * scale
        out[b, h, t] = logits.softmax(0) @ v[b, h // group, keys].double()
    return out
