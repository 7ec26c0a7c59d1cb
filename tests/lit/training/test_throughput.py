"""Metrics researchers expect: bits per byte, the gradient norm, FLOPs fed to Lightning's ThroughputMonitor.

The end-to-end check (a fit that logs them all to metrics.csv) is in test_lit_data.py.
"""

import math
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import ThroughputMonitor

from flexmoba import MobaSpec
from flexmoba.model import ModelConfig
from lit.training.metrics import IGNORE_INDEX
from lit.training.module import LitLM
from lit.training.throughput import ModelFlopsThroughput

TINY = dict(n_layers=2, d_model=32, n_heads=2, n_kv_heads=1, moba=MobaSpec(8, 2, backend="sdpa"))
SEQ_LEN = 32


def tiny_module() -> LitLM:
    torch.manual_seed(0)
    return LitLM(ModelConfig(**TINY), seq_len=SEQ_LEN, position_window=16, trailing_window=16)


def random_batch(batch_size: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (batch_size, SEQ_LEN + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def capture_logs(module: LitLM, monkeypatch) -> dict[str, float]:
    logged = {}
    monkeypatch.setattr(module, "log", lambda name, value, **kwargs: logged.__setitem__(name, float(value)))
    return logged


def test_bits_per_byte_is_the_mean_loss_over_ln_2(monkeypatch):
    module = tiny_module()
    logged = capture_logs(module, monkeypatch)
    token_loss = torch.tensor([[1.0] * SEQ_LEN, [2.0] * SEQ_LEN])
    targets = torch.zeros(2, SEQ_LEN, dtype=torch.long)
    targets[1, SEQ_LEN // 2 :] = IGNORE_INDEX  # 32 tokens at 1.0, 16 at 2.0: mean 4/3 nats
    for stage in ("val", "test"):
        valid = targets != IGNORE_INDEX
        module.metrics[f"{stage}_loss"].update(token_loss * valid, targets)
        module.metrics[f"{stage}_windows"].update(token_loss * valid, targets)
        module.metrics[f"{stage}_trailing"].update(token_loss * valid, targets)
        module._log_eval(stage)
        assert logged[f"{stage}/loss"] == pytest.approx(4 / 3)
        assert logged[f"{stage}/bpb"] == pytest.approx(4 / 3 / math.log(2))


def test_grad_norm_is_the_total_norm_before_the_step(monkeypatch):
    module = tiny_module()
    logged = capture_logs(module, monkeypatch)
    token_loss, targets = module.token_losses(random_batch())
    token_loss.mean().backward()
    grads = torch.cat([p.grad.flatten() for p in module.parameters() if p.grad is not None])
    module.on_before_optimizer_step(optimizer=None)
    assert logged["train/grad_norm"] == pytest.approx(float(grads.norm()), rel=1e-5)
    assert logged["train/grad_norm"] > 0


@pytest.mark.parametrize("training", [True, False])
def test_flops_per_batch_counts_the_latest_batch(training):
    module = tiny_module()
    module._trainer = SimpleNamespace(training=training)
    batch = random_batch(batch_size=3)
    with torch.no_grad():
        module.token_losses(batch)
    per_token = module.config.flops_per_token(SEQ_LEN, training=training)
    assert module.flops_per_batch == pytest.approx(per_token * 3 * SEQ_LEN)


def test_throughput_monitor_is_added_unless_the_trainer_has_one():
    module = tiny_module()
    module._trainer = SimpleNamespace(callbacks=[], log_every_n_steps=7)
    (monitor,) = module.configure_callbacks()
    assert isinstance(monitor, ModelFlopsThroughput) and monitor.kwargs["window_size"] == 7
    mine = ThroughputMonitor(batch_size_fn=len)
    module._trainer = SimpleNamespace(callbacks=[mine], log_every_n_steps=7)
    assert module.configure_callbacks() == []
