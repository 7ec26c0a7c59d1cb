"""Prompted generation from a LitLM checkpoint."""

import lightning as L
import pytest
import torch

from flexmoba import MobaSpec
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
    model = gen.load_model(str(tiny_checkpoint))
    greedy = gen.generate(model, b"import ", 12)
    assert len(greedy) == 12
    assert gen.generate(model, b"import ", 12, temperature=1.0, top_k=1) == greedy

    def sample(seed):
        return gen.generate(model, b"import ", 12, 1.0, None, torch.Generator().manual_seed(seed))

    assert sample(3) == sample(3) and sample(3) != sample(4)
