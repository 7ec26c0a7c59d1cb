"""Where every position sits: its document, and its MoBA chunk inside that document.

Chunks of ``chunk_size`` tokens start at each document's first token, so only a
document's last chunk may be partial. Chunks are indexed two ways:

- *local*: the chunk's index inside its own document (``0 .. n_chunks - 1``). A query only
  ever attends chunks of its own document, so selections are indexed locally and
  ``n_chunks = ceil(S / chunk_size)`` is a static bound, whatever the documents are.
- *global*: a running index over all chunks of the row (``0 .. n_global_chunks - 1``),
  used to pool keys into chunk means.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flexmoba.index_math import floor_divide

__all__ = ["ChunkLayout", "chunk_layout", "document_starts"]


@dataclass(frozen=True)
class ChunkLayout:
    """Per-position chunk bookkeeping for a batch of ``B`` rows of ``S`` positions.

    Attributes:
        chunk_size: tokens per chunk.
        n_chunks: ``ceil(S / chunk_size)``, the most chunks any document can have.
        n_global_chunks: chunks over the whole row, all documents together.
        has_documents: whether document ids were given (else one document per row).
        doc_start: ``[B, S]`` position of the first token of each position's document;
            it doubles as the document's identity.
        local_chunk: ``[B, S]`` index of each position's chunk inside its document.
        global_chunk: ``[B, S]`` running index of each position's chunk over the row.
    """

    chunk_size: int
    n_chunks: int
    n_global_chunks: int
    has_documents: bool
    doc_start: torch.Tensor
    local_chunk: torch.Tensor
    global_chunk: torch.Tensor

    @property
    def first_global_chunk(self) -> torch.Tensor:
        """``[B, S]`` global index of the first chunk of each position's document."""
        return self.global_chunk - self.local_chunk

    @property
    def chunk_start(self) -> torch.Tensor:
        """``[B, S]`` position of the first token of each position's chunk."""
        return self.doc_start + self.local_chunk * self.chunk_size


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` ids -> ``[B, S]`` start of each position's document.

    A document is a maximal run of equal ids, so ``[7, 7, 3, 3, 7]`` holds three documents.
    """
    B, S = document_ids.shape
    positions = torch.arange(S, device=document_ids.device).expand(B, S)
    is_start = torch.ones_like(document_ids, dtype=torch.bool)
    is_start[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return torch.where(is_start, positions, 0).cummax(dim=1).values


def chunk_layout(
    batch: int,
    seq_len: int,
    chunk_size: int,
    device: torch.device,
    document_ids: torch.Tensor | None = None,
) -> ChunkLayout:
    """Lay ``B`` rows of ``S`` positions out into MoBA chunks.

    Without documents every tensor is a function of the position alone and nothing is
    read back to the host. With documents the number of global chunks depends on the data
    and is read back once (one host sync), to size the chunk-mean table.
    """
    n_chunks = -(-seq_len // chunk_size)
    positions = torch.arange(seq_len, device=device).expand(batch, seq_len)
    if document_ids is None:
        doc_start = torch.zeros_like(positions)
        local_chunk = floor_divide(positions, chunk_size)
        return ChunkLayout(chunk_size, n_chunks, n_chunks, False, doc_start, local_chunk, local_chunk)

    doc_start = document_starts(document_ids)
    offset = positions - doc_start
    local_chunk = offset // chunk_size
    global_chunk = torch.cumsum(offset % chunk_size == 0, dim=1) - 1
    n_global_chunks = int(global_chunk[:, -1].max()) + 1
    return ChunkLayout(chunk_size, n_chunks, n_global_chunks, True, doc_start, local_chunk, global_chunk)
