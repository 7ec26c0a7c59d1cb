"""Prompted generation from a LitLM checkpoint."""

import lightning as L
import pytest
import torch

from flexmoba import MobaSpec
from flexmoba.checkpoint import load_model
from flexmoba.model import ModelConfig
from lit.cli import generate as gen
from lit.training.module import LitLM


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    module = LitLM(ModelConfig(n_layers=1, d_model=32, n_heads=2, moba=MobaSpec(8, 2, backend="sdpa")),
                   seq_len=64, position_window=16, trailing_window=16)
    trainer = L.Trainer(max_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=1)
    trainer.strategy.connect(module)
    path = tmp_path_factory.mktemp("ckpt") / "tiny.ckpt"
    trainer.save_checkpoint(path)
    return path


@pytest.mark.parametrize("temperature, top_k", [(0.0, None), (0.7, 5)])
def test_cli_prints_prompt_plus_requested_bytes(tiny_checkpoint, capsysbinary, temperature, top_k):
    args = ["--ckpt", str(tiny_checkpoint), "--prompt", "def ", "--max_new_bytes", "17",
            "--temperature", str(temperature)]
    gen.main(args + ([] if top_k is None else ["--sample_top_k", str(top_k)]))
    out = capsysbinary.readouterr().out
    assert out.startswith(b"def ") and out.endswith(b"\n")
    assert len(out) == len(b"def ") + 17 + 1


def test_sampling_is_seeded_and_top_k_one_is_greedy(tiny_checkpoint):
    model = load_model(str(tiny_checkpoint))
    greedy = gen.generate(model, b"import ", 12)
    assert len(greedy) == 12
    assert gen.generate(model, b"import ", 12, temperature=1.0, top_k=1) == greedy

    def sample(seed):
        return gen.generate(model, b"import ", 12, 1.0, None, torch.Generator().manual_seed(seed))

    assert sample(3) == sample(3) and sample(3) != sample(4)


def test_cli_writes_each_byte_as_soon_as_it_is_sampled(tiny_checkpoint, monkeypatch):
    import flexmoba.model

    events = []
    sample = flexmoba.model.sample_next_token

    def sampled(*args, **kwargs):
        events.append("sample")
        return sample(*args, **kwargs)

    class Written:
        def write(self, data):
            events.append(("write", bytes(data)))
            return len(data)

        def flush(self):
            events.append("flush")

    class Stdout:
        buffer = Written()

        def isatty(self):
            return False

        def flush(self):
            events.append("flush")

    monkeypatch.setattr(flexmoba.model, "sample_next_token", sampled)
    monkeypatch.setattr(gen, "sample_next_token", sampled, raising=False)
    monkeypatch.setattr(gen.sys, "stdout", Stdout())
    gen.main(["--ckpt", str(tiny_checkpoint), "--prompt", "def ", "--max_new_bytes", "5"])
    writes = [event for event in events if event != "flush"]
    # the prompt, then one written byte after each sample, before the next sample: a stream, not one write at the end
    assert writes[0] == ("write", b"def ") and writes[-1] == ("write", b"\n"), writes
    assert [e if e == "sample" else "write" for e in writes[1:-1]] == ["sample", "write"] * 5, writes
    assert all(len(event[1]) == 1 for event in writes[1:-1] if event != "sample"), writes


def test_cli_says_once_when_it_generates_past_the_length_the_model_was_trained_on(tiny_checkpoint, capsysbinary):
    gen.main(["--ckpt", str(tiny_checkpoint), "--prompt", "def ", "--max_new_bytes", "70"])  # 4 + 70 > seq_len 64
    captured = capsysbinary.readouterr()
    assert len(captured.out) == 4 + 70 + 1
    assert captured.err.decode() == ("flexmoba: note: past 64 bytes, the length the model was trained on (seq_len "
                                     "64): what follows runs on positions it never saw in training\n")
    gen.main(["--ckpt", str(tiny_checkpoint), "--prompt", "def ", "--max_new_bytes", "60"])  # 4 + 60 = 64: within it
    assert capsysbinary.readouterr().err == b""


def test_streaming_gives_the_tokens_of_the_model_s_own_generate(tiny_checkpoint):
    model = load_model(str(tiny_checkpoint))
    prompt = torch.tensor([list(b"import ")])
    for temperature, top_k, seed in [(0.0, None, 0), (0.9, 7, 3)]:
        expected = model.generate(prompt, 20, temperature, top_k, torch.Generator().manual_seed(seed))[0, 7:]
        generator = torch.Generator().manual_seed(seed)
        streamed = list(gen.stream(model, list(b"import "), 20, temperature, top_k, generator))
        assert streamed == expected.tolist()


@pytest.fixture(scope="module")
def token_checkpoint(tiny_checkpoint, tmp_path_factory):
    """The tiny model carrying a tokenizer of its 256 tokens: a token-level model, as an import is."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    checkpoint = torch.load(tiny_checkpoint, weights_only=False)
    checkpoint["tokenizer"] = {"tokenizer_json": tokenizer.to_str()}
    path = tmp_path_factory.mktemp("token_ckpt") / "tokens.ckpt"
    torch.save(checkpoint, path)
    return path


def test_max_new_bytes_on_a_model_that_reads_tokens_is_refused(token_checkpoint, capsys):
    from lit.training.errors import UsageError

    with pytest.raises(UsageError, match="--max_new_bytes: .* reads tokens, not bytes .*; give --max_new_tokens 5"):
        gen.main(["--ckpt", str(token_checkpoint), "--prompt", "w1 w2", "--max_new_bytes", "5"])
    gen.main(["--ckpt", str(token_checkpoint), "--prompt", "w1 w2", "--max_new_tokens", "5"])
    assert capsys.readouterr().out.count("w") == 2 + 5  # the prompt's tokens and 5 more


def test_max_new_tokens_on_a_byte_level_model_is_refused(tiny_checkpoint):
    from lit.training.errors import UsageError

    with pytest.raises(UsageError, match="--max_new_tokens: .* reads bytes, not tokens .*; give --max_new_bytes 5"):
        gen.main(["--ckpt", str(tiny_checkpoint), "--max_new_tokens", "5"])
