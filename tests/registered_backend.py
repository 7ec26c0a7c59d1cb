"""A backend as a user would register one: plain masked softmax, written here from the protocol
alone (no flexmoba kernel), so that context parallelism and decoding are shown to run any
registered backend, not only the built-in ones."""

import torch

from flexmoba import register_backend
from flexmoba.backends import registry

NAME = "test-masked-softmax"


def _attend_where(q, k, v, allowed, scale):
    """``softmax(q k^T * scale)`` over ``allowed: [B, H, S, T]`` in fp64, KV heads repeated."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(group, 1) for x in (k, v))
    logits = (q.double() @ k.transpose(-1, -2)) * scale
    return logits.masked_fill(~allowed, float("-inf")).softmax(-1).matmul(v).to(q.dtype)


def attend(q, k, v, selection, scale, *, query_start=0):
    """Query i (position ``query_start + i``) attends key s iff s is in its document, not after it,
    and in its own chunk or a valid selected past chunk (chunks counted from the document start)."""
    layout = selection.layout
    S, T = q.shape[2], k.shape[2]
    t = query_start + torch.arange(S)
    s = torch.arange(T)
    from_start = s[None, None, :] - layout.doc_start[:, :, None]  # [B, S, T]
    key_chunk = torch.div(from_start, layout.chunk_size, rounding_mode="floor")
    visible = (from_start >= 0) & (s[None, None, :] <= t[None, :, None])
    own = key_chunk == layout.local_chunk[:, :, None]  # [B, S, T]
    past = (key_chunk[:, None, :, :, None] == selection.past_chunks[:, :, :, None, :]) \
        & selection.past_valid[:, :, :, None, :]  # [B, H, S, T, P]
    return _attend_where(q, k, v, (own[:, None] | past.any(-1)) & visible[:, None], scale)


def decode(step):
    """The new queries at ``step.q_pos`` over every cached key (a cache without padding)."""
    assert not step.sums.padded, "the stand-in decodes unpadded caches"
    s = torch.arange(step.keys.shape[2])
    key_chunk = s // step.sums.chunk_size
    own = key_chunk[None, None, :] == step.own[:, :, None]  # [B, S_new, T]
    past = (key_chunk[None, None, None, :, None] == step.past[:, :, :, None, :]) & step.valid[:, :, :, None, :]
    visible = s[None, :] <= step.q_pos[:, None]  # [S_new, T]
    return _attend_where(step.q, step.keys, step.values, (own[:, None] | past.any(-1)) & visible, step.scale)


def register(context_parallel: bool = True, debug: bool = False) -> str:
    register_backend(NAME, attend, decode=decode, context_parallel=context_parallel, replace=True, debug=debug)
    return NAME


def unregister() -> None:
    registry._registered.pop(NAME, None)
