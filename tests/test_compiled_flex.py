"""The compiled flex raises dynamo's recompile limit for its own calls only."""

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from flexmoba import compiled_flex_attention, moba_block_mask
from flexmoba.backends.flex.compiled import FLEX_RECOMPILE_LIMIT, with_recompile_limit

from strategies import random_inputs

SHAPES = 10  # more than dynamo's default limit of 8


def add_one(x):
    return x + 1


def compile_shapes(fn) -> None:
    for n in range(1, SHAPES + 1):
        fn(torch.ones(n))


def test_more_shapes_than_the_default_limit_compile_and_the_setting_is_untouched():
    before = torch._dynamo.config.recompile_limit
    assert before < SHAPES <= FLEX_RECOMPILE_LIMIT
    counter = CompileCounter()
    compile_shapes(with_recompile_limit(torch.compile(add_one, backend=counter, dynamic=False)))
    assert counter.frame_count == SHAPES
    assert torch._dynamo.config.recompile_limit == before


def test_without_the_wrapper_dynamo_stops_compiling_at_its_limit():
    """What the wrapper prevents: past the limit dynamo falls back to running ``fn`` eagerly."""
    def add_two(x):
        return x + 2

    counter = CompileCounter()
    compile_shapes(torch.compile(add_two, backend=counter, dynamic=False))
    assert counter.frame_count == torch._dynamo.config.recompile_limit < SHAPES


@pytest.mark.slow
def test_a_compiled_flex_call_leaves_the_recompile_limit_unchanged():
    before = torch._dynamo.config.recompile_limit
    q, k, v = random_inputs(0, 1, 2, 1, 64, 8)
    with torch.no_grad():
        compiled_flex_attention()(q, k, v, block_mask=moba_block_mask(q, k, chunk_size=16, top_k=2, block_size=16),
                                  enable_gqa=True)
    assert torch._dynamo.config.recompile_limit == before
