"""A flexmoba checkpoint exported as a Hugging Face Llama computes the same logits."""

import json

import pytest
import torch

pytest.importorskip("transformers")
L = pytest.importorskip("lightning")
from transformers import AutoModelForCausalLM  # noqa: E402

from flexmoba import MobaSpec  # noqa: E402
from flexmoba.checkpoint import load_model  # noqa: E402
from flexmoba.integrations import transformers as hf  # noqa: E402
from flexmoba.model import ModelConfig  # noqa: E402
from lit.cli import export_hf  # noqa: E402
from lit.training.module import LitLM  # noqa: E402

TOL = dict(rtol=1e-4, atol=1e-4)  # fp32
S = 40
TINY = dict(vocab_size=256, d_model=64, n_heads=4, n_kv_heads=2, moba=MobaSpec(8, 2, backend="sdpa"), init_std=0.1)
MODELS = {  # name: (ModelConfig fields, phase override, expected config.moba["full_attention_last_n_layers"])
    "moba": (dict(n_layers=2), None, 0),
    "full": (dict(n_layers=2, attention="full", tie_embeddings=False), None, 2),
    "hybrid": (dict(n_layers=3, full_attention_last_n_layers=1, rope_base=500.0), None, 1),
    "phase-switched": (dict(n_layers=2), "full", 2),
}

hf.register()


pytestmark = pytest.mark.usefixtures("one_thread")


def save_tiny_checkpoint(path, fields: dict, override: str | None):
    """A training checkpoint (Lightning's format) of a tiny model with random weights, norms included."""
    torch.manual_seed(0)
    module = LitLM(ModelConfig(**{**TINY, **fields}), seq_len=64, position_window=16, trailing_window=16)
    with torch.no_grad():
        for p in module.model.parameters():
            if p.dim() == 1:  # RMSNorm gains: away from 1 so that a swapped norm shows
                p.copy_(1 + 0.5 * torch.randn_like(p))
    module.model.set_attention_override(override)
    trainer = L.Trainer(max_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=1)
    trainer.strategy.connect(module)
    trainer.save_checkpoint(path)
    return path


@pytest.fixture(scope="module", params=list(MODELS))
def exported(request, tmp_path_factory):
    """``(name, checkpoint path, export folder)`` of one tiny model."""
    fields, override, _ = MODELS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    ckpt = save_tiny_checkpoint(root / "tiny.ckpt", fields, override)
    out = export_hf.main(["--ckpt", str(ckpt), "--out", str(root / "hf")])
    return request.param, ckpt, out


def tokens(B=2, length=S, seed=1):
    return torch.randint(0, 256, (B, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def hf_logits(folder, attn, ids):
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attn).eval()
    return model(ids).logits


def test_export_writes_the_moba_settings(exported):
    name, _, out = exported
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["moba"] == {"chunk_size": 8, "top_k": 2, "full_attention_last_n_layers": MODELS[name][2]}
    assert config["max_position_embeddings"] == 64  # the training seq_len


def test_exported_logits_equal_the_flexmoba_model(exported):
    _, ckpt, out = exported
    ids = tokens()
    with torch.no_grad():
        expected = load_model(ckpt)(ids)
    torch.testing.assert_close(hf_logits(out, "flexmoba", ids), expected, **TOL)


def test_full_export_runs_on_plain_sdpa_and_moba_export_is_sparse(exported):
    name, ckpt, out = exported
    ids = tokens()
    with torch.no_grad():
        expected = load_model(ckpt)(ids)
    sdpa = hf_logits(out, "sdpa", ids)
    if MODELS[name][2] == load_model(ckpt).config.n_layers:
        torch.testing.assert_close(sdpa, expected, **TOL)
    else:
        assert (sdpa - expected).abs().max() > 1e-3  # MoBA layers really skip chunks here


def test_exported_greedy_generation_equals_flexmoba_decoding(exported):
    _, ckpt, out = exported
    prompt = tokens(B=1, length=30)
    model = AutoModelForCausalLM.from_pretrained(out, attn_implementation="flexmoba").eval()
    with torch.no_grad():
        ours = load_model(ckpt).generate(prompt, 10)
        theirs = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False,
                                pad_token_id=0)
    assert theirs.tolist() == ours.tolist()


def test_layers_in_an_order_llama_cannot_express_are_refused():
    from flexmoba.integrations.export import moba_settings

    with pytest.raises(ValueError, match="MoBA layers followed by full"):
        moba_settings(ModelConfig(), ["full", "moba", "moba", "moba"])


def test_training_checkpoints_hold_plain_data_only(exported, tmp_path):
    _, ckpt, _ = exported
    checkpoint = torch.load(ckpt, weights_only=True)  # raises on any pickled object
    assert isinstance(checkpoint["hyper_parameters"]["config"], dict)
    restored = LitLM.load_from_checkpoint(ckpt, weights_only=True)  # Lightning's own loader, dict -> ModelConfig
    assert restored.config == load_model(ckpt).config
    checkpoint["hyper_parameters"]["config"] = ModelConfig(**checkpoint["hyper_parameters"]["config"])
    torch.save(checkpoint, tmp_path / "pickled.ckpt")  # as checkpoints were written before
    with pytest.raises(ValueError, match="pickled objects.*weights_only=True"):
        load_model(tmp_path / "pickled.ckpt")


def test_tile_granularity_exports_and_refuses_cached_moba_decoding(tmp_path):
    tiles = MobaSpec(8, 2, granularity=4, backend="sdpa")
    ckpt = save_tiny_checkpoint(tmp_path / "tiles.ckpt", dict(n_layers=2, moba=tiles), None)
    out = export_hf.main(["--ckpt", str(ckpt), "--out", str(tmp_path / "hf")])
    ids = tokens()
    with torch.no_grad():
        expected = load_model(ckpt)(ids)
    model = AutoModelForCausalLM.from_pretrained(out, attn_implementation="flexmoba").eval()
    assert model.config.moba["granularity"] == 4
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, **TOL)
        with pytest.raises(ValueError, match="granularity=4 has no decode path"):
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False,
                           pad_token_id=0)


def test_bfloat16_export(exported, tmp_path):
    _, ckpt, out = exported
    half = export_hf.main(["--ckpt", str(ckpt), "--out", str(tmp_path / "bf16"), "--dtype", "bfloat16"])
    model = AutoModelForCausalLM.from_pretrained(half, attn_implementation="flexmoba")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    full = AutoModelForCausalLM.from_pretrained(out, attn_implementation="flexmoba")
    assert all(torch.equal(a.bfloat16(), b) for a, b in zip(full.parameters(), model.parameters(), strict=True))


def word_level_tokenizer(path, size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(size)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return path


def test_a_byte_model_exports_no_tokenizer_unless_given_one(exported, tmp_path):
    from transformers import AutoTokenizer

    _, ckpt, out = exported
    assert not (out / "tokenizer.json").exists()
    given = word_level_tokenizer(tmp_path / "words.json", 256)
    with_tokenizer = export_hf.main(["--ckpt", str(ckpt), "--out", str(tmp_path / "hf"), "--tokenizer", str(given)])
    assert AutoTokenizer.from_pretrained(with_tokenizer)("w3 w255")["input_ids"] == [3, 255]


@pytest.mark.parametrize(("size", "words"), [(257, "257 tokens, more than the model's vocab_size=256"),
                                             (None, "is not a tokenizer.json file")])
def test_a_tokenizer_that_cannot_go_with_the_model_is_one_line(exported, tmp_path, capsys, size, words):
    _, ckpt, _ = exported
    path = tmp_path / "tokenizer.json" if size is None else word_level_tokenizer(tmp_path / "words.json", size)
    with pytest.raises(SystemExit) as exit_info:
        export_hf.main(["--ckpt", str(ckpt), "--out", str(tmp_path / "hf"), "--tokenizer", str(path)])
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 2 and stderr.count("\n") == 1, stderr
    assert stderr.startswith("flexmoba: error: --tokenizer: ") and words in stderr, stderr
    assert not (tmp_path / "hf").exists()
