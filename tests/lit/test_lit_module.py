"""LightningModule pieces: schedule, MoBA == full when it covers the sequence, phase switch."""

import lightning as L
import pytest
import torch

from flexmoba.model import ModelConfig
from lit.callbacks import AttentionPhaseSwitch
from lit.data import PythonSourceData
from lit.module import LitLM, warmup_cosine

TINY = dict(n_layers=2, d_model=32, n_heads=2, n_kv_heads=1, moba_backend="sdpa")


def test_warmup_then_cosine():
    assert warmup_cosine(0, 4, 20, 0.1) == pytest.approx(0.25)
    assert warmup_cosine(3, 4, 20, 0.1) == pytest.approx(1.0)
    assert warmup_cosine(4, 4, 20, 0.1) == pytest.approx(1.0)
    assert warmup_cosine(12, 4, 20, 0.1) == pytest.approx(0.55)
    assert warmup_cosine(20, 4, 20, 0.1) == pytest.approx(0.1)
    assert warmup_cosine(50, 4, 20, 0.1) == pytest.approx(0.1)


@pytest.mark.parametrize("backend", ["sdpa", "auto"])
def test_moba_loss_equals_full_when_chunks_cover_the_sequence(backend):
    torch.manual_seed(0)
    seq_len = 96
    moba = LitLM(ModelConfig(**{**TINY, "moba_backend": backend}, moba_chunk_size=32, moba_top_k=3),
                 seq_len=seq_len, position_window=32, trailing_window=32)
    full = LitLM(ModelConfig(**TINY, attention="full"), seq_len=seq_len, position_window=32, trailing_window=32)
    full.load_state_dict(moba.state_dict())
    inputs = torch.randint(0, 256, (2, seq_len + 1), generator=torch.Generator().manual_seed(1))
    batch = (inputs[:, :-1].contiguous(), inputs[:, 1:].contiguous())
    with torch.no_grad():
        moba_loss, _ = moba.token_losses(batch)
        full_loss, _ = full.token_losses(batch)
    torch.testing.assert_close(moba_loss, full_loss, rtol=1e-5, atol=1e-5)
    # ... and the training path (with gradients) agrees too.
    moba_train, _ = moba.token_losses(batch)
    torch.testing.assert_close(moba_train.detach(), full_loss, rtol=1e-5, atol=1e-5)


def test_phase_switch_goes_full_at_the_given_fraction(tmp_path):
    data = PythonSourceData(seq_len=64, batch_size=2, max_files=3, cache_dir=str(tmp_path / "cache"))
    module = LitLM(ModelConfig(**TINY, moba_chunk_size=16, moba_top_k=2), seq_len=64,
                   position_window=32, trailing_window=32, warmup_steps=1)
    seen = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(pl_module.model.layer_attention().count("moba"))

    trainer = L.Trainer(
        max_steps=8, callbacks=[AttentionPhaseSwitch(switch_to_full_at=0.75), Record()], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, accelerator="cpu", default_root_dir=tmp_path,
    )
    trainer.fit(module, datamodule=data)
    assert seen == [2] * 6 + [0] * 2
    # The switch travels with checkpoints.
    checkpoint = {}
    module.on_save_checkpoint(checkpoint)
    fresh = LitLM(ModelConfig(**TINY), seq_len=64, position_window=32, trailing_window=32)
    fresh.on_load_checkpoint(checkpoint)
    assert fresh.model.layer_attention() == ["full", "full"]


def test_phase_switch_rejects_bad_fraction():
    with pytest.raises(ValueError, match="switch_to_full_at"):
        AttentionPhaseSwitch(switch_to_full_at=1.5)
