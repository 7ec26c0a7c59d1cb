"""The model: shapes, causality, parameter and FLOP formulas, attention switching."""

import pytest
import torch

from flexmoba import MobaSpec
from flexmoba.model import GPT, ModelConfig
from flexmoba.pair_counts import keys_attended_full, keys_attended_moba

TINY = dict(n_layers=2, d_model=32, n_heads=4, n_kv_heads=None, moba=MobaSpec(16, 2, backend="sdpa"))


def tiny(**overrides) -> ModelConfig:
    return ModelConfig(**{**TINY, **overrides})


def tokens(batch=2, seq_len=64, seed=0):
    return torch.randint(0, 256, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("overrides", [
    {}, {"n_kv_heads": 2}, {"n_kv_heads": 1, "tie_embeddings": False}, {"attention": "full"},
    {"full_attention_last_n_layers": 1}, {"moba": MobaSpec(16, 2, granularity=4, backend="sdpa")},
])
def test_logits_shape(overrides):
    model = GPT(tiny(**overrides))
    assert model(tokens(3, 48)).shape == (3, 48, 256)


@pytest.mark.parametrize("attention", ["moba", "full"])
@pytest.mark.parametrize("architecture", ["llama", "gemma_style"])
def test_future_tokens_do_not_change_earlier_logits(attention, architecture):
    torch.manual_seed(0)
    model = GPT((tiny if architecture == "llama" else gemma_style)(attention=attention)).eval()
    x = tokens(2, 64)
    changed = x.clone()
    changed[:, 40:] = (changed[:, 40:] + 7) % 256
    with torch.no_grad():
        a, b = model(x), model(changed)
    torch.testing.assert_close(a[:, :40], b[:, :40], rtol=0, atol=1e-5)
    assert not torch.allclose(a[:, 40:], b[:, 40:])  # the test can fail: later logits do move


@pytest.mark.parametrize("overrides", [
    {}, {"n_kv_heads": 2}, {"tie_embeddings": False}, {"mlp_hidden": 48, "n_kv_heads": 1, "vocab_size": 300},
])
@pytest.mark.parametrize("non_embedding", [True, False])
def test_parameter_formula_matches_module(overrides, non_embedding):
    config = tiny(**overrides)
    model = GPT(config)
    counted = sum(p.numel() for p in model.parameters())  # tied weights appear once
    if non_embedding:
        counted -= config.vocab_size * config.d_model * (1 if config.tie_embeddings else 2)
    assert config.num_parameters(non_embedding=non_embedding) == counted == model.num_parameters(non_embedding)


def test_hybrid_layers_and_runtime_override():
    model = GPT(tiny(n_layers=3, full_attention_last_n_layers=1))
    assert model.layer_attention() == ["moba", "moba", "full"]
    model.set_attention_override("full")
    assert model.layer_attention() == ["full"] * 3
    model.set_attention_override(None)
    assert model.layer_attention() == ["moba", "moba", "full"]
    with pytest.raises(ValueError, match="override"):
        model.set_attention_override("sparse")


def test_moba_covering_the_sequence_equals_full_attention():
    torch.manual_seed(0)
    moba = GPT(tiny(moba=MobaSpec(32, 2, backend="sdpa"))).eval()  # 32 * 2 >= 64
    full = GPT(tiny(attention="full")).eval()
    full.load_state_dict(moba.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(moba(tokens()), full(tokens()), rtol=1e-5, atol=1e-5)


def test_sparse_moba_differs_from_full_attention():
    torch.manual_seed(0)
    model = GPT(tiny(moba=MobaSpec(8, 2, backend="sdpa"))).eval()
    with torch.no_grad():
        moba_logits = model(tokens())
        model.set_attention_override("full")
        full_logits = model(tokens())
    assert not torch.allclose(moba_logits, full_logits, atol=1e-4)


@pytest.mark.parametrize("field, value", [
    ("d_model", 30), ("n_kv_heads", 3), ("attention", "linear"), ("full_attention_last_n_layers", 5), ("n_layers", 0),
])
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        tiny(**{field: value})


def test_generate_appends_tokens():
    model = GPT(tiny()).eval()
    out = model.generate(tokens(1, 10), max_new_tokens=5)
    assert out.shape == (1, 15) and torch.equal(out[:, :10], tokens(1, 10))


def test_keys_attended_by_hand():
    # S=6, chunk 2, top_k 2: queries 0..5 attend 1, 2, 2+1, 2+2, 2+1, 2+2 keys.
    assert keys_attended_moba(6, chunk_size=2, top_k=2) == 1 + 2 + 3 + 4 + 3 + 4
    assert keys_attended_full(6) == 21
    assert keys_attended_moba(64, chunk_size=16, top_k=4) == keys_attended_full(64)
    assert keys_attended_moba(1024, chunk_size=128, top_k=3) < keys_attended_full(1024)


def test_flop_accounting():
    config = tiny(moba=MobaSpec(2, 2, backend="sdpa"), n_layers=2, full_attention_last_n_layers=1)
    per_pair = 4 * config.n_heads * config.head_dim
    expected = per_pair * (keys_attended_moba(6, 2, 2) + keys_attended_full(6))
    assert config.attention_flops_per_sequence(6, training=False) == expected
    assert config.attention_flops_per_sequence(6) == 3 * expected
    assert config.dense_flops_per_token() == 6 * config.num_parameters(non_embedding=True)
    assert tiny(moba=MobaSpec(32, 2, backend="sdpa")).attention_sparsity(64) == 0.0


@pytest.mark.parametrize("attention, kv_heads", [("moba", 2), ("moba", 4), ("full", 2)])
def test_cached_decoding_equals_one_parallel_forward(attention, kv_heads):
    torch.manual_seed(0)
    config = ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=kv_heads, attention=attention,
                         moba=MobaSpec(8, 2, backend="sdpa"),
                         full_attention_last_n_layers=1 if attention == "moba" else 0)
    model = GPT(config).eval()
    tokens = torch.randint(0, 256, (2, 45))
    with torch.no_grad():
        parallel = model(tokens)
        caches = model.new_caches()
        prefill = model(tokens[:, :13], caches)  # chunked prefill, then one token at a time
        steps = [model(tokens[:, t:t + 1], caches) for t in range(13, 45)]
    torch.testing.assert_close(torch.cat([prefill, *steps], dim=1), parallel, atol=1e-4, rtol=1e-4)


def test_cached_decoding_uses_the_config_spec_backend_included():
    model = GPT(tiny(moba=MobaSpec(16, 2, backend="flex"))).eval()  # flex does not decode
    with torch.no_grad(), pytest.raises(ValueError, match="backend 'flex' does not decode"):
        model(tokens(seq_len=8), model.new_caches())


def test_generate_with_and_without_cache_agree():
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layers=2, d_model=32, n_heads=2, moba=MobaSpec(4, 2, backend="sdpa"))).eval()
    prompt = torch.randint(0, 256, (1, 10))
    cached = model.generate(prompt, 20)
    recomputed = model.generate(prompt, 20, use_cache=False)
    assert cached.shape == (1, 30) and torch.equal(cached, recomputed)


# -- architecture as configuration: Gemma-style fields (the real Gemma 3: test_gemma3.py) -----------------

GEMMA_STYLE = dict(TINY, n_layers=3, n_kv_heads=2, head_dim=12, layer_types=["sliding", "sliding", "global"],
                   sliding_window=5, rope_base_local=500.0, qk_norm=True, sandwich_norms=True,
                   mlp_activation="gelu_tanh", embedding_scale=32**0.5, query_scale=0.2, norm_offset=1.0)


def gemma_style(**overrides) -> ModelConfig:
    return ModelConfig(**{**GEMMA_STYLE, **overrides})


def test_the_default_model_builds_the_same_modules_and_weights():
    """Checkpoints on disk keep loading: the Llama-style model has no module or weight the new fields add."""
    from flexmoba.integrations.export import LAYER_WEIGHTS, MODEL_WEIGHTS

    model = GPT(ModelConfig())
    layer_keys = {f"blocks.{i}.{name}" for i in range(4) for name in LAYER_WEIGHTS}
    assert set(model.state_dict()) == layer_keys | set(MODEL_WEIGHTS)
    kinds = {type(module).__name__ for module in model.modules()}
    assert kinds == {"GPT", "Embedding", "ModuleList", "Block", "RMSNorm", "CausalSelfAttention", "Linear", "GatedMLP"}
    assert all(type(module) is torch.nn.RMSNorm for module in model.modules() if "RMSNorm" in type(module).__name__)


def test_gemma_style_weights_are_named_and_counted():
    config = gemma_style()
    model = GPT(config)
    names = set(model.state_dict())
    assert {"blocks.0.attn.q_norm.weight", "blocks.0.attn.k_norm.weight", "blocks.2.attn_post_norm.weight",
            "blocks.2.mlp_post_norm.weight"} <= names
    for non_embedding in (True, False):
        assert config.num_parameters(non_embedding) == model.num_parameters(non_embedding)
    norm = model.blocks[0].attn_norm  # Gemma's weights are centered on 0: a fresh norm is still the identity scale
    assert torch.equal(norm.weight, torch.zeros(32))


def test_sliding_layers_keep_their_window_whatever_the_attention():
    model = GPT(gemma_style(attention="moba", full_attention_last_n_layers=2))
    assert model.layer_attention() == ["sliding", "sliding", "full"]  # MoBA only ever replaces a global layer
    assert GPT(gemma_style(attention="moba")).layer_attention() == ["sliding", "sliding", "moba"]
    model.set_attention_override("moba")
    assert model.layer_attention() == ["sliding", "sliding", "moba"]
    assert gemma_style().layer_rope_bases() == [500.0, 500.0, 10000.0]


def test_the_norm_with_an_offset_is_gemmas():
    from flexmoba.model import OffsetRMSNorm

    norm = OffsetRMSNorm(8, 1e-6, 1.0)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    x32 = x.float()
    expected = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + norm.weight)
    assert norm(x).dtype == torch.bfloat16 and torch.equal(norm(x), expected.to(torch.bfloat16))


def test_a_window_past_the_sequence_is_a_global_layer():
    """Sliding layers with a window of at least S (and the global RoPE base) compute the global model."""
    torch.manual_seed(0)
    windowed = GPT(gemma_style(sliding_window=64, rope_base_local=None, attention="full")).eval()
    plain = GPT(gemma_style(layer_types=None, sliding_window=None, rope_base_local=None, attention="full")).eval()
    plain.load_state_dict(windowed.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(windowed(tokens()), plain(tokens()), rtol=1e-5, atol=1e-5)
        windowed_short = GPT(gemma_style(sliding_window=8, rope_base_local=None, attention="full")).eval()
        windowed_short.load_state_dict(windowed.state_dict())
        assert not torch.allclose(windowed_short(tokens()), plain(tokens()), atol=1e-4)


@pytest.mark.parametrize("attention", ["moba", "full"])
def test_gemma_style_cached_decoding_equals_one_parallel_forward(attention):
    """The sliding layers decode over their window only: prefill and steps cross it many times."""
    torch.manual_seed(0)
    model = GPT(gemma_style(attention=attention, moba=MobaSpec(8, 2, backend="sdpa"))).eval()
    x = torch.randint(0, 256, (2, 45))
    with torch.no_grad():
        parallel = model(x)
        caches = model.new_caches()
        prefill = model(x[:, :13], caches)
        steps = [model(x[:, t:t + 1], caches) for t in range(13, 45)]
    torch.testing.assert_close(torch.cat([prefill, *steps], dim=1), parallel, atol=1e-4, rtol=1e-4)


def test_gemma_style_generate_with_and_without_cache_agree():
    torch.manual_seed(0)
    model = GPT(gemma_style(moba=MobaSpec(4, 2, backend="sdpa"))).eval()
    prompt = torch.randint(0, 256, (1, 10))
    assert torch.equal(model.generate(prompt, 20), model.generate(prompt, 20, use_cache=False))


def test_gemma_style_flop_accounting_counts_the_window():
    from flexmoba.sliding_window import keys_attended_sliding

    config = gemma_style(attention="full")
    per_pair = 4 * config.n_heads * config.head_dim
    expected = per_pair * (2 * keys_attended_sliding(100, 5) + keys_attended_full(100))
    assert config.attention_flops_per_sequence(100, training=False) == expected


@pytest.mark.parametrize("field, value", [
    ("layer_types", ["sliding", "global"]), ("layer_types", ["sliding", "local", "global"]), ("layer_types", "global"),
    ("sliding_window", None), ("sliding_window", 0), ("rope_base_local", -1.0), ("qk_norm", 1),
    ("sandwich_norms", "yes"), ("mlp_activation", "relu"), ("embedding_scale", 0.0), ("query_scale", float("nan")),
    ("norm_offset", float("inf")), ("norm_offset", True),
])
def test_bad_architecture_field_is_named(field, value):
    with pytest.raises(ValueError, match=f"ModelConfig.{field}"):
        gemma_style(**{field: value})


def test_a_gemma_style_checkpoint_loads_back_the_same_model():
    import dataclasses

    from flexmoba.checkpoint import load_model

    torch.manual_seed(0)
    model = GPT(gemma_style()).eval()
    checkpoint = {"config": dataclasses.asdict(model.config), "state_dict": model.state_dict()}
    loaded = load_model(checkpoint)
    assert loaded.config == model.config
    with torch.no_grad():
        assert torch.equal(loaded(tokens()), model(tokens()))
