"""LightningModule pieces: schedule, MoBA == full when it covers the sequence, phase switch,
the train loss over real targets, optimizer groups, learning, predict."""

import copy
import math
import os
from pathlib import Path

import lightning as L
import pytest
import torch

from flexmoba import MobaSpec
from flexmoba.model import ModelConfig
from lit.training.callbacks import AttentionPhaseSwitch
from lit.training.data import ByteFilesData
from lit.training.metrics import IGNORE_INDEX
from lit.training.module import LitLM, warmup_cosine, warmup_stable_decay

TINY = dict(n_layers=2, d_model=32, n_heads=2, n_kv_heads=1)
SDPA = MobaSpec(128, 3, backend="sdpa")


def test_warmup_then_cosine():
    assert warmup_cosine(0, 4, 20, 0.1) == pytest.approx(0.25)
    assert warmup_cosine(3, 4, 20, 0.1) == pytest.approx(1.0)
    assert warmup_cosine(4, 4, 20, 0.1) == pytest.approx(1.0)
    assert warmup_cosine(12, 4, 20, 0.1) == pytest.approx(0.55)
    assert warmup_cosine(20, 4, 20, 0.1) == pytest.approx(0.1)
    assert warmup_cosine(50, 4, 20, 0.1) == pytest.approx(0.1)


def test_warmup_stable_decay_is_constant_until_its_last_steps_then_linear():
    assert warmup_stable_decay(0, 4, 20, 5, 0.1) == pytest.approx(0.25)
    assert [warmup_stable_decay(s, 4, 20, 5, 0.1) for s in (3, 4, 14)] == [1.0, 1.0, 1.0]
    decay = [warmup_stable_decay(s, 4, 20, 5, 0.1) for s in range(15, 20)]
    assert decay == pytest.approx([0.82, 0.64, 0.46, 0.28, 0.1])
    assert warmup_stable_decay(30, 4, 20, 5, 0.1) == pytest.approx(0.1)
    # no decay: a trunk, constant whatever its length
    assert {warmup_stable_decay(s, 4, n, 0, 0.1) for n in (8, 20) for s in range(4, n)} == {1.0}


@pytest.mark.parametrize("backend", ["sdpa", "auto"])
def test_moba_loss_equals_full_when_chunks_cover_the_sequence(backend):
    torch.manual_seed(0)
    seq_len = 96
    moba = LitLM(ModelConfig(**TINY, moba=MobaSpec(32, 3, backend=backend)),
                 seq_len=seq_len, position_window=32, trailing_window=32)
    full = LitLM(ModelConfig(**TINY, attention="full", moba=SDPA), seq_len=seq_len, position_window=32,
                 trailing_window=32)
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
    data = ByteFilesData(seq_len=64, batch_size=2, max_files=3, cache_dir=str(tmp_path / "cache"))
    module = LitLM(ModelConfig(**TINY, moba=MobaSpec(16, 2, backend="sdpa")), seq_len=64,
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
    fresh = LitLM(ModelConfig(**TINY, moba=SDPA), seq_len=64, position_window=32, trailing_window=32)
    fresh.on_load_checkpoint(checkpoint)
    assert fresh.model.layer_attention() == ["full", "full"]


def test_phase_switch_rejects_bad_fraction():
    with pytest.raises(ValueError, match="switch_to_full_at"):
        AttentionPhaseSwitch(switch_to_full_at=1.5)


# -- what training, validation and predict compute, checked from the logits ---------------

QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
             accelerator="cpu", devices=1, num_sanity_val_steps=0)


def nll_by_hand(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(-log p(target) [B, S] in float64, valid [B, S])`` from plain log-softmax."""
    valid = targets != IGNORE_INDEX
    logp = logits.double().log_softmax(-1)
    return -logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0], valid


def python_like_corpus(root, n_files: int = 24) -> None:
    """Short files (10 to 100 bytes) of the stdlib's own text, so most sequences of 64 are padded."""
    source = Path(os.__file__).read_bytes()
    for i in range(n_files):
        start = 997 * i % (len(source) - 200)
        (root / f"m{i:02d}.py").write_bytes(source[start:start + 10 + 4 * i])


def test_train_loss_averages_over_real_targets_only(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    python_like_corpus(corpus)
    data = ByteFilesData(root=str(corpus), seq_len=64, batch_size=4, pad_short_docs=True,
                            val_fraction=0.2, cache_dir=str(tmp_path / "cache"))
    module = LitLM(ModelConfig(**TINY, moba=MobaSpec(8, 2, backend="sdpa")), seq_len=64, position_window=32,
                   trailing_window=32, warmup_steps=1)
    checked = []

    class Check(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            with torch.no_grad():  # the weights the step's loss is computed with
                nll, valid = nll_by_hand(pl_module.model(batch[0]), batch[1])
            assert (~valid).any(), "every batch here has padded targets"
            self.expected = nll[valid].mean()

        def on_before_backward(self, trainer, pl_module, loss):
            checked.append((loss.item(), self.expected.item()))

    L.Trainer(max_steps=4, limit_val_batches=0, callbacks=[Check()], **QUIET).fit(module, datamodule=data)
    assert len(checked) == 4
    for got, expected in checked:
        assert got == pytest.approx(expected, rel=1e-5)


def test_optimizer_decays_matrices_only():
    module = LitLM(ModelConfig(**TINY, tie_embeddings=False, moba=SDPA), seq_len=64, position_window=32,
                   trailing_window=32,
                   weight_decay=0.25, lr_decay_steps=10)
    groups = module.configure_optimizers()["optimizer"].param_groups
    decay = {id(p) for g in groups if g["weight_decay"] == 0.25 for p in g["params"]}
    no_decay = {id(p) for g in groups if g["weight_decay"] == 0.0 for p in g["params"]}
    assert len(groups) == 2 and not decay & no_decay
    names = {id(p): name for name, p in module.model.named_parameters()}
    assert decay | no_decay == set(names), "every parameter is optimised, once"
    matrices = {i for i, name in names.items() if name.endswith(("wq.weight", "wo.weight", "w_down.weight",
                                                                  "tok_emb.weight", "lm_head.weight"))}
    norms = {i for i, name in names.items() if "norm" in name}
    assert matrices <= decay and norms and norms <= no_decay
    assert all(module.model.get_parameter(names[i]).dim() >= 2 for i in decay)
    assert all(module.model.get_parameter(names[i]).dim() < 2 for i in no_decay)


def test_a_few_steps_learn_well_below_uniform(tmp_path, corpus_cache):
    """Uniform guessing over 256 bytes costs ln 256 = 5.55 nats; 20 steps of a tiny model on
    Python source must get far below that (about 3.2 is typical)."""
    torch.manual_seed(0)
    data = ByteFilesData(seq_len=64, batch_size=8, max_files=8, cache_dir=str(corpus_cache))
    module = LitLM(ModelConfig(**TINY, moba=MobaSpec(16, 2, backend="sdpa")), seq_len=64, position_window=32,
                   trailing_window=32, warmup_steps=2, lr=1e-2)
    trainer = L.Trainer(max_steps=20, limit_val_batches=4, val_check_interval=20, default_root_dir=tmp_path, **QUIET)
    # (A copy: metric states left by validate() are inference tensors that fit() cannot update.)
    before = trainer.validate(copy.deepcopy(module), datamodule=data, verbose=False)[0]["val/loss"]
    assert before == pytest.approx(math.log(256), abs=0.1), "an untrained model guesses uniformly"
    trainer.fit(module, datamodule=data)
    after = trainer.validate(module, datamodule=data, verbose=False)[0]["val/loss"]
    assert after < 4.0, after


def test_predict_returns_each_sequence_loss_and_its_greedy_continuation(tmp_path):
    torch.manual_seed(0)
    module = LitLM(ModelConfig(**TINY, moba=MobaSpec(8, 2, backend="sdpa")), seq_len=64, position_window=32,
                   trailing_window=32)
    tokens = torch.randint(0, 256, (3, 65), generator=torch.Generator().manual_seed(2))
    inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    targets[1, 40:] = IGNORE_INDEX  # a short (padded) sequence
    targets[2, 10:20] = IGNORE_INDEX  # ignored targets inside a sequence
    loader = torch.utils.data.DataLoader(list(zip(inputs, targets, strict=False)), batch_size=3)
    (out,) = L.Trainer(**QUIET).predict(module, dataloaders=loader)
    with torch.no_grad():
        nll, valid = nll_by_hand(module.model(inputs), targets)
        expected_loss = torch.stack([nll[b][valid[b]].mean() for b in range(3)])
        text = inputs[:, :32]
        for _ in range(16):  # greedy, re-reading the whole text each step (no cache)
            text = torch.cat([text, module.model(text)[:, -1].argmax(-1, keepdim=True)], 1)
    assert out["loss"].shape == (3,) and out["continuation"].shape == (3, 16)
    torch.testing.assert_close(out["loss"].double(), expected_loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(out["continuation"], text[:, 32:])
