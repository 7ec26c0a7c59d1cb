"""Pretrained Llama checkpoints into the GPT: transformers' own forward is the oracle; what the GPT cannot
represent is refused by name (flexmoba/integrations/pretrained.py). The real SmolLM2: test_smollm2.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")

from flexmoba.integrations.export import to_llama  # noqa: E402
from flexmoba.integrations.pretrained import PretrainedError, gpt_config, load_pretrained  # noqa: E402

from tiny_llama import VOCAB, save_tiny_llama, tiny_llama_config  # noqa: E402


def transformers_logits(folder, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_tiny_llama_imports_with_transformers_logits(tmp_path, tied):
    folder = save_tiny_llama(tmp_path / "hf", tie_word_embeddings=tied)
    pretrained = load_pretrained(folder)
    config = pretrained.model.config
    assert (config.head_dim, config.n_heads, config.n_kv_heads, config.d_model) == (12, 4, 2, 32)
    assert (config.norm_eps, config.rope_base, config.max_seq_len, config.tie_embeddings) == (1e-6, 50_000.0, 256, tied)
    assert config.attention == "full" and pretrained.tokenizer_json is not None
    tokens = torch.randint(0, VOCAB, (2, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = pretrained.model(tokens)
    theirs = transformers_logits(folder, tokens)
    assert theirs.abs().max() > 5  # logits large enough that a wrong mapping shows
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_import_export_import_is_exact(tmp_path, tied):
    first = load_pretrained(save_tiny_llama(tmp_path / "hf", tie_word_embeddings=tied, with_tokenizer=False))
    to_llama(first.model).save_pretrained(tmp_path / "exported")
    second = load_pretrained(tmp_path / "exported")
    assert dataclasses.asdict(second.model.config) == dataclasses.asdict(first.model.config)
    a, b = first.model.state_dict(), second.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_moba_settings_written_by_export_come_back(tmp_path):
    pretrained = load_pretrained(save_tiny_llama(tmp_path / "hf", with_tokenizer=False))
    moba = dataclasses.replace(pretrained.model.config, attention="moba", full_attention_last_n_layers=1)
    from flexmoba.model import GPT

    model = GPT(moba)
    model.load_state_dict(pretrained.model.state_dict())
    to_llama(model).save_pretrained(tmp_path / "exported")
    config = load_pretrained(tmp_path / "exported").model.config
    assert (config.attention, config.moba, config.full_attention_last_n_layers) == ("moba", moba.moba, 1)


@pytest.mark.parametrize("overrides, named", [
    ({"attention_bias": True}, "attention_bias=True"),
    ({"mlp_bias": True}, "mlp_bias=True"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type='linear'"),
])
def test_what_the_gpt_cannot_represent_is_refused_by_name(overrides, named):
    with pytest.raises(PretrainedError, match=named.replace("(", r"\(").replace("[", r"\[")):
        gpt_config(tiny_llama_config(**overrides))


def test_another_architecture_is_refused_before_its_weights_are_read(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64).save_pretrained(tmp_path)  # a config, no weights
    with pytest.raises(PretrainedError, match="model_type='gpt2': only llama"):
        load_pretrained(tmp_path)


def test_a_source_that_is_not_there_is_refused(tmp_path):
    with pytest.raises(PretrainedError, match="no such file or folder"):
        load_pretrained(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PretrainedError, match="without config.json"):
        load_pretrained(tmp_path / "empty")
