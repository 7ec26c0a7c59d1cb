"""flexmoba: exact MoBA (Mixture of Block Attention) for PyTorch: one gate, then one of several exact
backends (FlexAttention's block-sparse plan or union BlockMask, a gather kernel, SDPA with a dense mask),
for training, decoding and context parallelism.

Tensors are ``[B, H, S, D]``; keys and values may have fewer heads (``H % H_kv == 0``).
"""

__version__ = "0.1.0"  # the one place the version is written; pyproject.toml reads it

from flexmoba.attention import moba_attention
from flexmoba.backends import backend_names, register_backend
from flexmoba.backends.flex.block_mask import moba_block_mask, selection_block_mask
from flexmoba.backends.flex.compiled import compiled_flex_attention, use_flex_attention
from flexmoba.backends.flex.plan import MoBAFlexPlan, moba_flex_plan
from flexmoba.decode import moba_decode_attention
from flexmoba.gate import Selection, moba_selection, select_chunks
from flexmoba.kv_cache import MoBAKVCache
from flexmoba.masks import dense_moba_mask, moba_mask_mod
from flexmoba.reference import moba_reference
from flexmoba.spec import MobaSpec
from flexmoba.varlen import moba_attention_varlen

__all__ = [
    "__version__",
    "MoBAFlexPlan",
    "MoBAKVCache",
    "MobaSpec",
    "Selection",
    "backend_names",
    "compiled_flex_attention",
    "dense_moba_mask",
    "moba_attention",
    "moba_attention_varlen",
    "moba_block_mask",
    "moba_decode_attention",
    "moba_flex_plan",
    "moba_mask_mod",
    "moba_reference",
    "moba_selection",
    "register_backend",
    "select_chunks",
    "selection_block_mask",
    "use_flex_attention",
]
