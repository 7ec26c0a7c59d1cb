"""The ``gather`` backend's decode: each new query reads only the chunks it selected.

It takes a :class:`flexmoba.backends.protocol.DecodeStep` (new queries at the end of a KV cache, the gate
already run) and returns ``[B, H, S_new, Dv]`` in q's dtype. With fp32 q, keys and values and a chunk
state that keeps blocks, a query's logits against a chunk are one weighted sum of the D rows of that
chunk's transposed keys (:attr:`flexmoba.kv_cache.ChunkKeySums.blocks`) and its output one weighted sum of
value rows: ``embedding_bag`` computes both straight from the buffers, with no gathered copy. Otherwise it
gathers a copy of each query's selected keys and values (fp32 softmax).

Padding (left, ``start[b]`` the first real position of row b): real queries never attend the positions
before ``start``, even when they hold non-finite values; padding queries attend only themselves.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from flexmoba.backends.protocol import DecodeStep
from flexmoba.gate import fp32_matmul

__all__ = ["gather_decode", "gathered_attention"]


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """``x: [B, H_kv, T, D]`` as a ``[R, D]`` table of rows (no copy when each row is contiguous,
    e.g. a view of a cache buffer), and the row step of b, kv head and position."""
    D = x.shape[-1]
    if x.stride(-1) != 1 or any(st % D for st in x.stride()[:3]) or x.stride(2) != D:
        x = x.contiguous()
    steps = [st // D for st in x.stride()[:3]]
    n_rows = sum((size - 1) * st for size, st in zip(x.shape[:3], steps, strict=True)) + 1
    table = x.as_strided((n_rows, D), (D, 1), x.storage_offset())
    return table, steps


@functools.lru_cache(maxsize=64)
def _arange(n: int, device: torch.device) -> torch.Tensor:
    """``torch.arange(n)``, made once per size and device: decode steps reuse the same few."""
    return torch.arange(n, device=device)


@functools.lru_cache(maxsize=64)
def _kv_head(B: int, H: int, H_kv: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(batch [B, 1, 1, 1], kv head of each query head [1, H, 1, 1])`` for index arithmetic."""
    batch = torch.arange(B, device=device).view(B, 1, 1, 1)
    kv_head = (torch.arange(H, device=device) // (H // H_kv)).view(1, H, 1, 1)
    return batch, kv_head


def gathered_attention(q, keys, values, key_pos, allowed, scale):
    """Each query attends its own list of key positions.

    ``key_pos, allowed: [B, H, S_new, L]`` (positions into ``keys: [B, H_kv, T, D]``) ->
    ``[B, H, S_new, Dv]``. Softmax in fp32, like :func:`flexmoba.moba_reference`.
    """
    B, H, S_new, L = key_pos.shape
    batch, kv_head = _kv_head(B, H, keys.shape[1], q.device)

    def gather(x):  # [B, H_kv, T, D] -> [B, H, S_new, L, D] fp32
        table, steps = _rows(x)
        index = batch * steps[0] + kv_head * steps[1] + key_pos * steps[2]
        return table.index_select(0, index.flatten()).view(B, H, S_new, L, -1).float()

    logits = torch.einsum("bhsld,bhsd->bhsl", gather(keys), q.float()) * scale
    probs = logits.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    return torch.einsum("bhsl,bhsld->bhsd", probs, gather(values)).to(q.dtype)


def _slots(step: DecodeStep) -> tuple[torch.Tensor, torch.Tensor]:
    """The selected chunks as ``(chunks, used)``, each ``[B, H, S_new, P + 1]``, own chunk last."""
    B, H, S_new, _ = step.past.shape
    chunks = torch.cat([step.past, step.own[:, None, :, None].expand(B, H, S_new, 1)], dim=-1)
    return chunks, F.pad(step.valid, (0, 1), value=True)


def _blocks_selected(step: DecodeStep) -> torch.Tensor:
    """``[B, H, S_new, Dv]``: logits from the transposed key blocks, outputs from the value rows,
    both by ``embedding_bag``."""
    q, sums, q_local = step.q, step.sums, step.q_local
    B, H, S_new, _ = q.shape
    c = sums.chunk_size
    chunks, used = _slots(step)  # [B, H, S_new, K]
    # Past slots are all or nothing; the own chunk (last slot) is cut at the query.
    last = torch.where(used, c - 1, -1)
    last[..., -1] = (q_local - step.own * c)[:, None, :]
    allowed = _arange(c, q.device) <= last[..., None]  # [B, H, S_new, K, c]
    L = allowed.shape[-2] * c
    logits = _block_logits(q, sums.key_blocks(step.keys), chunks, step.scale).view(allowed.shape)
    logits = torch.where(allowed, logits, float("-inf")).view(B, H, S_new, L)
    if sums.padded:  # a padding query attends only itself: slot 0, its own row below
        logits[..., 0] = logits[..., 0].masked_fill((q_local < 0)[:, None, :], 0.0)
    probs = logits.softmax(dim=-1)

    table, steps = _rows(step.values)
    batch, kv_head = _kv_head(B, H, step.values.shape[1], q.device)
    row0 = batch * steps[0] + kv_head * steps[1] + sums.start.view(B, 1, 1, 1) * steps[2]  # local position 0
    own_row = row0[..., 0] + q_local[:, None, :] * steps[2]  # [B, H, S_new]
    first = row0 + chunks * (c * steps[2])  # [B, H, S_new, K]
    index = first[..., None] + _arange(c, q.device) * steps[2]
    # Masked-out slots read the query's own row (weight 0): a key it attends anyway, so a
    # non-finite value there cannot reach the output through 0 * inf.
    index = torch.where(allowed, index, own_row[..., None, None]).view(-1, L)
    out = F.embedding_bag(index, table, per_sample_weights=probs.view(-1, L), mode="sum")
    return out.view(B, H, S_new, -1).to(q.dtype)


def _one_query_blocks(step: DecodeStep) -> torch.Tensor:
    """:func:`_blocks_selected` for one new query per head of a cache without padding (the usual
    decode step). The own chunk and the query's place in it are host ints: the own chunk's
    logits come from its ``offset + 1`` keys by one product (not a whole chunk of transposed
    keys), the past chunks' by ``embedding_bag``. Logits and value-row indices are written into one
    row per head (past chunks, then own keys); the value rows in place, each part by one op."""
    q, sums = step.q, step.sums
    B, H, _, D = q.shape
    c, T = sums.chunk_size, step.keys.shape[2]
    own, offset = divmod(T - 1, c)
    P = step.past.shape[-1]
    blocks = sums.key_blocks(step.keys)  # [B, H_kv, N, D, c]
    H_kv, N = blocks.shape[1], blocks.shape[2]
    scaled = q.float().view(B, H, D) * step.scale
    table, steps = _rows(step.values)
    row0 = _head_rows(B, H, H_kv, steps[0], steps[1], q.device)  # [B, H, 1]: position 0 of each head's values
    position_rows = _arange(c, q.device) * steps[2]  # [c]: row offsets of a chunk's positions
    logits = scaled.new_empty(B, H, P * c + offset + 1)
    index = torch.empty(B, H, P * c + offset + 1, dtype=torch.long, device=q.device)
    own_keys = step.keys[:, :, own * c:].transpose(-1, -2)  # [B, H_kv, D, offset + 1]
    logits[..., P * c:] = fp32_matmul(scaled.view(B, H_kv, H // H_kv, D), own_keys).view(B, H, offset + 1)
    torch.add(row0 + own * c * steps[2], position_rows[: offset + 1], out=index[..., P * c:])
    if P:
        valid = step.valid.reshape(B, H, P)
        chunks = torch.where(valid, step.past.reshape(B, H, P), own)  # unused slots: the own chunk, weight 0
        first_block_row = (_head_rows(B, H, H_kv, H_kv * N, N, q.device) + chunks) * D  # [B, H, P]
        weights = scaled[:, :, None].expand(B, H, P, D)
        past = F.embedding_bag((first_block_row[..., None] + _arange(D, q.device)).reshape(-1, D), blocks.view(-1, c),
                               per_sample_weights=weights.reshape(-1, D), mode="sum").view(B, H, P, c)
        logits[..., : P * c] = torch.where(valid[..., None], past, float("-inf")).reshape(B, H, P * c)
        # An unused slot reads the query's own value row c times (weight 0): a row it attends anyway,
        # so a non-finite value elsewhere cannot reach the output through 0 * inf.
        first_row = torch.where(valid, row0 + chunks * (c * steps[2]), row0 + (T - 1) * steps[2])
        torch.addcmul(first_row[..., None], valid[..., None], position_rows, out=index[..., : P * c].view(B, H, P, c))
    probs = logits.softmax(dim=-1)
    out = F.embedding_bag(index.view(B * H, -1), table, per_sample_weights=probs.view(B * H, -1), mode="sum")
    return out.view(B, H, 1, -1).to(q.dtype)


@functools.lru_cache(maxsize=64)
def _head_rows(B: int, H: int, H_kv: int, batch_step: int, head_step: int, device: torch.device) -> torch.Tensor:
    """``[B, H, 1]``: ``b * batch_step + kv head * head_step`` for each query head's (batch, KV head)."""
    batch, kv_head = _kv_head(B, H, H_kv, device)
    return (batch * batch_step + kv_head * head_step)[..., 0]


def _block_logits(q, blocks, chunks, scale):
    """``q . k * scale`` of ``q: [B, H, S_new, D]`` with every key of its ``chunks: [B, H, S_new, K]``,
    read from ``blocks: [B, H_kv, N, D, c]`` -> ``[B, H, S_new, K * c]`` fp32.

    One bag per (query, chunk): the chunk's D rows of ``blocks`` weighted by the query. Bags
    run in (kv head, query, slot, head in group) order, so the heads of a group read their
    shared own chunk back to back, while it is still in cache.
    """
    B, H, S_new, D = q.shape
    H_kv, N, c = blocks.shape[1], blocks.shape[2], blocks.shape[-1]
    g, K = H // H_kv, chunks.shape[-1]
    by_group = chunks.view(B, H_kv, g, S_new, K).permute(0, 1, 3, 4, 2).contiguous()  # [B, H_kv, S_new, K, g]
    first = (by_group + _arange(B * H_kv, q.device).view(B, H_kv, 1, 1, 1) * N) * D
    index = (first[..., None] + _arange(D, q.device)).view(-1, D)
    weights = (q.float() * scale).view(B, H_kv, g, S_new, 1, D).permute(0, 1, 3, 4, 2, 5)
    weights = weights.expand(B, H_kv, S_new, K, g, D).reshape(-1, D)
    logits = F.embedding_bag(index, blocks.view(-1, c), per_sample_weights=weights, mode="sum")
    return logits.view(B, H_kv, S_new, K, g, c).permute(0, 1, 4, 2, 3, 5).reshape(B, H, S_new, K * c)


def _gather_selected(step: DecodeStep) -> torch.Tensor:
    """Gather each query's selected chunks (past ones whole, its own up to itself) and attend."""
    q, q_pos, c = step.q, step.q_pos, step.sums.chunk_size
    B, H, S_new, _ = q.shape
    T = step.keys.shape[2]
    chunks, used = _slots(step)
    first = step.sums.start[:, None, None, None] + chunks * c
    # A padding query's "own chunk" starts at itself, so it attends only itself.
    first[..., -1] = torch.where((step.q_local < 0)[:, None, :], q_pos[None, None, :], first[..., -1])
    positions = first[..., None] + torch.arange(c, device=q.device)  # [B, H, S_new, P + 1, c]
    allowed = used[..., None] & (positions <= q_pos[None, None, :, None, None])
    L = positions.shape[-2] * c
    return gathered_attention(q, step.keys, step.values, positions.clamp(max=T - 1).view(B, H, S_new, L),
                              allowed.view(B, H, S_new, L), step.scale)


def gather_decode(step: DecodeStep) -> torch.Tensor:
    """``"gather"``'s decode: the ``embedding_bag`` kernel on fp32 buffers whose chunk state
    keeps blocks, the gathered copy otherwise (see the module docstring)."""
    fp32 = step.q.dtype == step.keys.dtype == step.values.dtype == torch.float32
    if not (fp32 and step.sums.keep_blocks):
        return _gather_selected(step)
    return _one_query_blocks(step) if step.q.shape[2] == 1 and not step.sums.padded else _blocks_selected(step)
