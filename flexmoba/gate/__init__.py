"""MoBA gating: which chunks each query attends.

For a query at position t of a document (per head):

    score[j] = q_t . mean(k over chunk j)          (fp32, no scale, no gradient)
    own      = the chunk holding t                  (always attended, causal inside)
    past     = top_k - 1 highest-scoring chunks j < own (all of them if fewer);
               among exactly equal scores the later chunk wins (:mod:`flexmoba.gate.ties`)

Chunks after ``own`` are never attended. A past chunk whose score is NaN or -inf (from
non-finite inputs) is never selected, so a non-finite key cannot win a slot by accident;
the query then attends fewer chunks. Non-finite values still reach the output through
the chunks that are attended (the own chunk always), as in any attention.

With ``granularity=g`` all queries of each ``g``-token tile (tiles start at document
starts, and ``g`` divides ``chunk_size``) are scored with the tile's mean query, so they
share one selection: MoBA at tile granularity, an ablation, not the paper's model.

Three entries, one per caller: :func:`select_chunks` (a whole sequence), :func:`select_local_chunks`
(a slice of queries over all keys: context parallelism) and :func:`select_against_means` (new
queries against a KV cache's chunk means: decoding). The package is split by what the gate does:
:mod:`~flexmoba.gate.scores` (means and query rows), :mod:`~flexmoba.gate.selection` (top-k per
shape), :mod:`~flexmoba.gate.maxima` (the maxima) and :mod:`~flexmoba.gate.ties` (the tie rule).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from flexmoba import validation
from flexmoba.gate.scores import chunk_means, fp32_matmul, gate_rows
from flexmoba.gate.selection import select_before_chunk, select_past_chunks, select_past_chunks_on_grid
from flexmoba.layout import ChunkLayout, chunk_layout
from flexmoba.spec import MobaSpec, takes_settings

__all__ = [
    "Selection",
    "chunk_means",
    "fp32_matmul",
    "gate",
    "moba_selection",
    "select_against_means",
    "select_chunks",
    "select_local_chunks",
]


@dataclass(frozen=True)
class Selection:
    """The chunks each query attends.

    Attributes:
        past_chunks: ``[B, H, S, P]`` local indices of the selected past chunks,
            ``P = min(top_k - 1, n_chunks - 1)``; entries with ``past_valid`` False are unused.
        past_valid: ``[B, H, S, P]`` bool.
        layout: the chunk layout the indices refer to.
        spec: the settings the gate ran with.
        chunks: ``[B, H, S, n_chunks]`` bool, built on first use (the sparse backends never
            need it); ``chunks[b, h, t, j]`` says query t of head h attends the j-th chunk of
            its own document (own chunk included).
    """

    past_chunks: torch.Tensor
    past_valid: torch.Tensor
    layout: ChunkLayout
    spec: MobaSpec

    @property
    def granularity(self) -> str | int:
        """``"token"`` or the tile size whose queries share one selection."""
        return self.spec.granularity

    @functools.cached_property
    def chunks(self) -> torch.Tensor:
        B, H, S, _ = self.past_chunks.shape
        chunks = torch.zeros(B, H, S, self.layout.n_chunks, dtype=torch.bool, device=self.past_chunks.device)
        own = self.layout.local_chunk[:, None, :, None].expand(B, H, S, 1)
        chunks.scatter_(-1, torch.where(self.past_valid, self.past_chunks, own), True)  # unused slots: own
        chunks.scatter_(-1, own, True)
        return chunks


@takes_settings
def select_chunks(
    q: torch.Tensor,
    k: torch.Tensor,
    spec: MobaSpec,
    *,
    document_ids: torch.Tensor | None = None,
    layout: ChunkLayout | None = None,
) -> Selection:
    """Validate the inputs and run MoBA's gate over a whole sequence.

    Args:
        q: ``[B, H, S, D]`` queries.
        k: ``[B, H_kv, S, D]`` keys, ``H % H_kv == 0``.
        spec: MoBA's settings (:class:`flexmoba.MobaSpec`; its backend is not the gate's
            concern), or give them as keywords ``chunk_size``, ``top_k``, ``granularity``.
        document_ids: optional ``[B, S]`` ints; each run of equal ids is one document.
        layout: the :func:`flexmoba.layout.chunk_layout` of these documents, when the caller
            built it already (a model builds it once per forward for all its layers).

    Returns:
        The :class:`Selection`.
    """
    validation.check_gate_inputs(q, k, document_ids)
    return gate(q, k, spec, document_ids=document_ids, layout=layout)


def gate(q: torch.Tensor, k: torch.Tensor, spec: MobaSpec, *, document_ids: torch.Tensor | None = None,
         layout: ChunkLayout | None = None) -> Selection:
    """:func:`select_chunks` on inputs its caller checked already (:func:`flexmoba.moba_attention` checks
    q, k, v and the documents once, then gates here)."""
    B, H, S, _ = q.shape
    if layout is None:
        layout = chunk_layout(B, S, spec.chunk_size, q.device, document_ids)
    validation.check_layout(layout, B, S, spec.chunk_size, document_ids)
    with torch.no_grad():
        rows, own, positions_per_row = gate_rows(q.detach(), layout, spec.granularity)
        means = chunk_means(k.detach(), layout)
        if layout.has_documents:
            past_chunks, past_valid = select_past_chunks(rows, means, layout.global_chunk, spec.top_k,
                                                         layout.n_chunks, first=layout.first_global_chunk)
        else:
            past_chunks, past_valid = select_past_chunks_on_grid(rows, means, spec.chunk_size // positions_per_row,
                                                                 spec.top_k)
        if positions_per_row > 1:
            past_chunks = past_chunks.repeat_interleave(positions_per_row, dim=2)[:, :, :S]
            past_valid = past_valid.repeat_interleave(positions_per_row, dim=2)[:, :, :S]
    return Selection(past_chunks, past_valid, layout, spec)


def layout_rows(layout: ChunkLayout, start: int, length: int) -> ChunkLayout:
    """The layout of positions ``[start, start + length)`` of ``layout``'s rows (chunk indices unchanged)."""
    cut = lambda x: x[:, start:start + length].contiguous()  # noqa: E731
    return dataclasses.replace(layout, doc_start=cut(layout.doc_start), local_chunk=cut(layout.local_chunk),
                               global_chunk=cut(layout.global_chunk))


def select_local_chunks(q: torch.Tensor, k: torch.Tensor, spec: MobaSpec, query_start: int,
                        document_ids: torch.Tensor | None = None) -> Selection:
    """MoBA's gate for queries ``q: [B, H, S, D]`` at positions ``[query_start, query_start + S)``
    of keys ``k: [B, H_kv, T, D]`` (all positions ``[0, T)``; ``document_ids: [B, T]``): context
    parallelism's gate.

    The selection's layout holds the queries' rows (global positions, global chunk indices);
    its chunk indices equal those of :func:`select_chunks` over the whole sequence.
    """
    validation.check_local_queries(q, k, None, query_start)
    if spec.granularity != "token":
        raise ValueError(f"MobaSpec.granularity must be 'token' under context parallelism, got "
                         f"{spec.granularity!r} (a tile may straddle ranks)")
    B, H, S, _ = q.shape
    T = k.shape[2]
    if document_ids is not None:
        validation.check_document_ids(document_ids, k)
    key_layout = chunk_layout(B, T, spec.chunk_size, q.device, document_ids)
    layout = layout_rows(key_layout, query_start, S)
    with torch.no_grad():
        rows, _, _ = gate_rows(q.detach(), layout, "token")
        means = chunk_means(k.detach(), key_layout)
        past_chunks, past_valid = select_past_chunks(rows, means, layout.global_chunk, spec.top_k, layout.n_chunks,
                                                     first=layout.first_global_chunk)
    return Selection(past_chunks, past_valid, layout, spec)


def select_against_means(
    q: torch.Tensor, means: torch.Tensor, own: torch.Tensor | None, top_k: int, *, own_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate the inputs and run MoBA's gate against precomputed chunk means (decoding from
    a KV cache, whose running sums hold the means): the scoring and tie rule of :func:`select_chunks`.

    Args:
        q: ``[B, H, S, D]`` queries, each gated alone (token granularity).
        means: ``[B, H_kv, N, D]`` fp32 chunk means, rounded through the key dtype like
            :func:`chunk_means`; query head h gates against KV head ``h // (H / H_kv)``.
        own: ``[B, S]`` ints in ``[0, N)``, each query's own chunk; only chunks before it compete.
        top_k: chunks per query, counting its own chunk.
        own_chunk: instead of ``own`` (None), the one chunk every query sits in, when the caller
            knows it (a host int: decoding's usual step, no spans, no bias).

    Returns:
        ``(past_chunks, past_valid)``, each ``[B, H, S, P]`` with ``P = min(top_k - 1, N - 1)``,
        as in :class:`Selection`.
    """
    top_k = validation.check_positive_int(top_k, "top_k")
    if own_chunk is not None:
        validation.check_own_chunk(own, own_chunk, means)
        with torch.no_grad():
            return select_before_chunk(q.detach().float(), means, own_chunk, top_k)
    validation.check_means_gate(q, means, own)
    with torch.no_grad():
        return select_past_chunks(q.detach().float(), means, own, top_k, means.shape[2])


@takes_settings
def moba_selection(
    q: torch.Tensor,
    k: torch.Tensor,
    spec: MobaSpec,
    *,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which chunks each query attends, own chunk included (arguments as :func:`select_chunks`).

    Returns:
        ``[B, H, S, ceil(S / chunk_size)]`` bool; index j is the j-th chunk of the
        query's own document.
    """
    return select_chunks(q, k, spec, document_ids=document_ids).chunks
