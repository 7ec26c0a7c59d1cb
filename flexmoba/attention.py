"""MoBA attention: validate, gate once, dispatch to a backend (:mod:`flexmoba.backends`)."""

from __future__ import annotations

import torch

from flexmoba import validation
from flexmoba.backends import get_backend, resolve_backend
from flexmoba.backends.checked import checked_attend
from flexmoba.gate import gate
from flexmoba.layout import ChunkLayout
from flexmoba.spec import MobaSpec, takes_settings

__all__ = ["moba_attention"]


@takes_settings
def moba_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: MobaSpec,
    *,
    scale: float | None = None,
    document_ids: torch.Tensor | None = None,
    layout: ChunkLayout | None = None,
) -> torch.Tensor:
    """Causal MoBA attention.

    Args:
        q: ``[B, H, S, D]``; k, v: ``[B, H_kv, S, D]`` with ``H % H_kv == 0``.
        spec: MoBA's settings as one :class:`flexmoba.MobaSpec`, or give them as keywords:
            ``chunk_size`` (tokens per chunk; chunks restart at each document start), ``top_k``
            (chunks per query, counting its own chunk), ``granularity`` (``"token"``, the paper
            and the default, or an int tile size dividing ``chunk_size``) and ``backend``
            (``"auto"``, the default, or a registered backend: ``"flex"``, ``"flex_union"``,
            ``"gather"``, ``"sdpa"``, or one added with :func:`flexmoba.register_backend`).
        scale: softmax scale, default ``D ** -0.5``.
        document_ids: optional ``[B, S]`` ints; nothing attends across documents.
        layout: optional prebuilt chunk layout of these documents (built once per model
            forward and shared by its layers; see :func:`flexmoba.gate.select_chunks`).

    Returns:
        ``[B, H, S, Dv]`` in q's dtype.
    """
    validation.check_qkv(q, k, v)
    validation.check_document_ids(document_ids, q)
    scale = validation.softmax_scale(scale, q)
    selection = gate(q, k, spec, document_ids=document_ids, layout=layout)
    name = resolve_backend(spec, q, k, v)
    return checked_attend(name, get_backend(name))(q, k, v, selection, scale, query_start=0)
