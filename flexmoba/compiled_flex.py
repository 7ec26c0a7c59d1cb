"""The process-wide compiled ``flex_attention``."""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import flex_attention

__all__ = ["compiled_flex_attention"]

_compiled_flex = None
# Each new shape compiles a new flex kernel; dynamo's default limit of 8 per function
# would otherwise drop to the unfused eager path after a few shapes.
FLEX_RECOMPILE_LIMIT = 64


def compiled_flex_attention():
    """The process-wide compiled ``flex_attention`` (compiled lazily, once).

    ``dynamic=False``: one kernel per shape. A dynamic kernel breaks on CPU once a second
    shape appears (torch 2.13), and training shapes are fixed anyway.
    """
    global _compiled_flex
    if _compiled_flex is None:
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, FLEX_RECOMPILE_LIMIT)
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex
