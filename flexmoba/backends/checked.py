"""The gate around a registered backend's output: shape, dtype and device on every call, and in debug
mode the values too, against MoBA's dense math on a sample of query rows.

A kernel of one's own is where a wrong answer is most likely and least visible, so attention, decoding
and context parallelism call every backend added with :func:`flexmoba.register_backend` through
:func:`checked_attend` (its decode through :func:`checked_decode`). The built-ins are proven by the test
suites and run unwrapped. The default check reads only tensor metadata: a value check would read the
output (on a GPU, a host sync in every layer).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from flexmoba.backends.protocol import AttendFn, DecodeFn, DecodeStep
from flexmoba.backends.registry import backend
from flexmoba.backends.sdpa.decode import sdpa_decode
from flexmoba.masks import dense_moba_rows

if TYPE_CHECKING:
    from flexmoba.gate import Selection

__all__ = ["DEBUG_ROWS", "checked_attend", "checked_decode", "sample_rows"]

DEBUG_ROWS = 16  # query rows per call compared in debug mode: the first, the last, evenly between
TOLERANCE = {torch.float64: 1e-8, torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def checked_attend(name: str, fn: AttendFn) -> AttendFn:
    """``fn``, backend ``name``'s ``attend(q, k, v, selection, scale, *, query_start=0)``, returning only an
    output of the protocol's shape, dtype and device (and in debug mode one that matches the dense math)
    when the backend is a registered one; the built-ins' as they are."""
    entry = backend(name)
    if not entry.checked:
        return fn

    @functools.wraps(fn)
    def attend(q, k, v, selection, scale, *, query_start: int = 0):
        out = fn(q, k, v, selection, scale, query_start=query_start)
        check_output(name, "attention", out, q, v)
        if entry.debug:
            rows = sample_rows(q.shape[2], DEBUG_ROWS, q.device)
            check_values(name, out[:, :, rows], reference_rows(q, k, v, selection, scale, query_start, rows), rows)
        return out

    return attend


def checked_decode(name: str, fn: DecodeFn) -> DecodeFn:
    """``fn``, backend ``name``'s ``decode(step)``, under the same checks, in debug mode against the
    ``sdpa`` backend's decode (every new query: a decode call holds few)."""
    entry = backend(name)
    if not entry.checked:
        return fn

    @functools.wraps(fn)
    def decode(step: DecodeStep):
        out = fn(step)
        check_output(name, "decode", out, step.q, step.values)
        if entry.debug:
            rows = torch.arange(step.q.shape[2], device=step.q.device)
            check_values(name, out, sdpa_decode(step).float(), rows)
        return out

    return decode


def check_output(name: str, role: str, out, q: torch.Tensor, v: torch.Tensor) -> None:
    """``RuntimeError`` naming backend ``name`` unless ``out`` is a ``[B, H, S, Dv]`` tensor of q's
    dtype on q's device (``B, H, S`` of q, ``Dv`` of v)."""
    if not isinstance(out, torch.Tensor):
        raise RuntimeError(f"backend {name!r} ({role}) returned {type(out).__name__}, not a tensor")
    expected = (*q.shape[:3], v.shape[-1])
    problems = []
    if tuple(out.shape) != expected:
        problems.append(f"shape {list(out.shape)}, expected [B, H, S, Dv] = {list(expected)}")
    if out.dtype != q.dtype:
        problems.append(f"dtype {out.dtype}, expected q's {q.dtype}")
    if out.device != q.device:
        problems.append(f"device {out.device}, expected q's {q.device}")
    if problems:
        raise RuntimeError(f"backend {name!r} ({role}) returned {'; '.join(problems)}")


def check_values(name: str, out: torch.Tensor, reference: torch.Tensor, rows: torch.Tensor) -> None:
    """``RuntimeError`` naming the first query row where ``out [B, H, R, Dv]`` and the fp32
    ``reference`` differ beyond the output dtype's tolerance (NaN only where the reference has one)."""
    tolerance = TOLERANCE.get(out.dtype, 5e-2)
    close = torch.isclose(out.float(), reference, rtol=tolerance, atol=tolerance, equal_nan=True)
    if bool(close.all()):
        return
    b, h, r, _ = (int(i) for i in (~close).nonzero()[0])
    error = (out.float() - reference).abs().nan_to_num(float("inf")).max()
    raise RuntimeError(f"backend {name!r} differs from MoBA's dense math (debug check) at batch row {b}, head {h}, "
                       f"query {int(rows[r])}: largest difference {float(error):.3g}, tolerance {tolerance:g}")


def sample_rows(S: int, n: int, device: torch.device) -> torch.Tensor:
    """``[R]`` at most ``n`` query rows of ``S``: the first, the last and evenly spaced between."""
    return torch.linspace(0, S - 1, min(n, S), device=device).round().long().unique()


def reference_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: Selection, scale: float,
                   query_start: int, rows: torch.Tensor) -> torch.Tensor:
    """``[B, H, R, Dv]`` fp32: queries ``rows`` of ``q [B, H, S, D]`` (at ``query_start + rows``) over
    ``k, v [B, H_kv, T, D]`` by ``softmax(masked q k^T * scale) v``."""
    allowed = dense_moba_rows(selection, query_start + rows, k.shape[2], rows)
    group = q.shape[1] // k.shape[1]
    logits = (q[:, :, rows].float() @ k.float().repeat_interleave(group, 1).transpose(-1, -2)) * scale
    probs = logits.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    return probs @ v.float().repeat_interleave(group, 1)
