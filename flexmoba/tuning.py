"""Tuning: every measured threshold of the library, one profile per device kind.

The values change speed, never results: each threshold picks between exact paths. A profile
is chosen by the device of the call's tensors (:func:`tuning_for`); :func:`use_tuning` overrides
it for a block (a context variable: the override stays in its thread and its ``with``), which is
how tests reach every path and how a user tries other values without editing the library.

The CPU values were measured on 2-core x86 VMs (fp32, ``python -m benchmarks.attention``); a
change lands only if an end-to-end number moves beyond the measured noise (CONTRIBUTING.md).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = ["PROFILES", "Tuning", "tuning_for", "use_tuning"]


@dataclass(frozen=True)
class Tuning:
    """Thresholds between exact paths.

    Attributes:
        auto_gather_min_seq: ``backend="auto"`` on this device picks ``gather`` from this many
            tokens once some chunk can be skipped (``S > chunk_size * top_k``), ``sdpa`` below
            (``None``: ``flex`` everywhere).
        auto_tile_flex_min_seq: tile granularity without gradients picks ``flex`` (the exactly
            sparse union mask) from this many tokens.
        decode_gather_max_queries: decoding reads each query's selected keys up to this many new
            queries; beyond (chunked prefill) one ``[S_new, T]`` mask for SDPA.
        max_query_groups: at most this many groups of query chunks (grid gate) or spans of
            positions (documents) scored apart.
        group_scores: causal scores per group of query chunks; groups grow as
            ``sqrt(causal scores / group_scores)``.
        span_scores: the same for spans of positions (documents, context parallelism, decoding).
        gate_buffer_scores: the most scores one group or span holds at once (more groups or spans
            when needed, past ``max_query_groups``): the gate's memory stays linear in S.
        spans_read_host: spans of positions get their chunk bounds from a host read (tighter
            spans; off CPU a device sync, so there spans of every chunk).
        few_scores: up to this many scores, each slot's maximum comes from ``max`` with indices.
        pooled_maxima: beyond ``few_scores``, maxima from ``max_pool2d`` (CPU: one vectorised
            pass) rather than ``amax`` passes (CUDA's pooling kernel takes 32-bit offsets).
        gather_query_block: rows of the smallest block of gather's past pairs.
        gather_batched_pairs_max_bytes: gather batches its past pairs into blocks while their
            copied keys stay under this many bytes, else one call per chunk.
        gather_split_own_min: gather's own-chunk attention runs as two causal halves from this
            chunk size on (the CPU kernel computes a chunk's whole square).
        gather_fused_kernel: gather's dense parts run torch's fused CPU flash-attention kernel
            (which also returns the log-sum-exp); otherwise the same math unfused.
        gather_unfused_scores: the unfused math runs its batch in pieces of at most this many fp32
            scores (own chunks are ``chunk_size ** 2`` each): its memory stays linear in S.
        flex_table_entries: the regrouped flex plan runs its virtual rows in pieces whose block
            tables, as wide as every key block, hold at most this many entries each (batch and KV
            heads included): its tables stay linear in S.
    """

    auto_gather_min_seq: int | None = None
    auto_tile_flex_min_seq: int | None = None
    decode_gather_max_queries: int = 16
    max_query_groups: int = 16
    group_scores: int = 2**19
    span_scores: int = 2**16
    gate_buffer_scores: int = 2**26
    spans_read_host: bool = False
    few_scores: int = 2**14
    pooled_maxima: bool = False
    gather_query_block: int = 64
    gather_batched_pairs_max_bytes: int = 64 * 2**20
    gather_split_own_min: int = 256
    gather_fused_kernel: bool = False
    gather_unfused_scores: int = 2**26
    flex_table_entries: int = 2**26


# Measured: gather beats the regrouped flex plan on CPU at every length and the dense-mask SDPA
# call from 512 tokens; the union BlockMask is exactly sparse and fastest at length for tiles.
PROFILES: dict[str, Tuning] = {
    "cpu": Tuning(auto_gather_min_seq=512, auto_tile_flex_min_seq=4096, spans_read_host=True,
                  gate_buffer_scores=2**23, pooled_maxima=True, gather_fused_kernel=True,
                  flex_table_entries=2**24),
    "cuda": Tuning(),
}
DEFAULT_PROFILE = "cuda"  # other accelerators: flex, amax passes

_override: contextvars.ContextVar[Tuning | None] = contextvars.ContextVar("flexmoba_tuning", default=None)


def tuning_for(device: torch.device | str) -> Tuning:
    """The profile of ``device``'s kind, or the one :func:`use_tuning` set for this block."""
    override = _override.get()
    if override is not None:
        return override
    kind = device if isinstance(device, str) else device.type
    return PROFILES.get(kind, PROFILES[DEFAULT_PROFILE])


@contextlib.contextmanager
def use_tuning(profile: str | Tuning = "cpu", **changes) -> Iterator[Tuning]:
    """Run the block with one profile (a name of :data:`PROFILES` or a :class:`Tuning`) on every
    device, with ``changes`` applied to it (field names of :class:`Tuning`)."""
    if isinstance(profile, str) and profile not in PROFILES:
        raise ValueError(f"profile must be one of {tuple(PROFILES)} or a Tuning, got {profile!r}")
    base = PROFILES[profile] if isinstance(profile, str) else profile
    tuning = dataclasses.replace(base, **changes)
    token = _override.set(tuning)
    try:
        yield tuning
    finally:
        _override.reset(token)
