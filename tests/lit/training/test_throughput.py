"""Metrics researchers expect: bits per byte, the gradient norm, FLOPs fed to Lightning's ThroughputMonitor.

The end-to-end check (a fit that logs them all to metrics.csv) is in test_lit_data.py.
"""

import math
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.loggers import Logger

from flexmoba import MobaSpec
from flexmoba.model import ModelConfig
from lit.training import throughput
from lit.training.guards import DivergenceGuard
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


def test_bits_per_byte_of_tokens_divide_by_the_bytes_per_token(monkeypatch):
    module = tiny_module()
    logged = capture_logs(module, monkeypatch)
    token_data = SimpleNamespace(bytes_per_token={"val": 2.5, "test": 4.0}.get)
    monkeypatch.setattr(module, "_trainer", SimpleNamespace(datamodule=token_data), raising=False)
    for stage, bytes_per_token in (("val", 2.5), ("test", 4.0)):
        module.metrics[f"{stage}_loss"].update(torch.full((1, SEQ_LEN), 3.0), torch.zeros(1, SEQ_LEN, dtype=torch.long))
        module._log_eval(stage)
        assert logged[f"{stage}/bpb"] == pytest.approx(3.0 / math.log(2) / bytes_per_token)


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
    assert isinstance(monitor, ModelFlopsThroughput) and monitor.kwargs["window_size"] == 2
    mine = ThroughputMonitor(batch_size_fn=len)
    module._trainer = SimpleNamespace(callbacks=[mine], log_every_n_steps=7)
    assert module.configure_callbacks() == []


# -- measured at log steps only ------------------------------------------------------------------

class MetricsLogger(Logger):
    """Every ``log_metrics`` call, kept in memory."""

    def __init__(self):
        super().__init__()
        self.rows: list[tuple[int, dict[str, float]]] = []

    name, version = "memory", 0

    def log_hyperparams(self, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.rows.append((step, dict(metrics)))


class CountingModule(L.LightningModule):
    """A linear model on ``(inputs [4, 8], targets)`` batches reporting a fixed FLOP count."""

    flops_per_batch = 1000.0

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0].float()).pow(2).mean()

    def train_dataloader(self):
        inputs = torch.zeros(64, 8, dtype=torch.long)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, inputs), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_throughput_waits_for_the_device_only_when_it_logs(monkeypatch):
    """A clock reading the trainer's step (one second a step) gives exact rates; the device is
    waited for at the start and at the log steps only, never at the other steps."""
    trainer = L.Trainer(max_steps=12, log_every_n_steps=4, callbacks=[ModelFlopsThroughput()],
                        logger=(logger := MetricsLogger()), enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False, accelerator="cpu")
    waited_at = []
    monkeypatch.setattr(throughput, "wait_for_device", lambda trainer: waited_at.append(trainer.global_step))
    monkeypatch.setattr(throughput, "perf_counter", lambda: float(trainer.global_step))
    trainer.fit(CountingModule())
    assert waited_at == [0, 4, 8, 12]
    logged = [(step, metrics) for step, metrics in logger.rows if "throughput/train/batches" in metrics]
    assert [metrics["throughput/train/batches"] for _, metrics in logged] == [4, 8, 12]
    for _, metrics in logged:
        assert metrics["throughput/train/device/batches_per_sec"] == pytest.approx(1.0)
        assert metrics["throughput/train/device/samples_per_sec"] == pytest.approx(4.0)
        assert metrics["throughput/train/device/items_per_sec"] == pytest.approx(32.0)  # 4 x 8 tokens a second
        assert metrics["throughput/train/device/flops_per_sec"] == pytest.approx(1000.0)


def test_the_steps_after_the_last_log_step_are_counted_when_the_fit_ends(monkeypatch):
    """12 steps logged every 5: the counters end at 12 batches (a report reads a run's tokens from them)."""
    trainer = L.Trainer(max_steps=12, log_every_n_steps=5, callbacks=[ModelFlopsThroughput()],
                        logger=(logger := MetricsLogger()), enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False, accelerator="cpu")
    monkeypatch.setattr(throughput, "perf_counter", lambda: float(trainer.global_step))
    trainer.fit(CountingModule())
    logged = [metrics for _, metrics in logger.rows if "throughput/train/batches" in metrics]
    assert [metrics["throughput/train/batches"] for metrics in logged] == [5, 10, 12]
    assert logged[-1]["throughput/train/lengths"] == 12 * 4 * 8 and logged[-1]["throughput/train/time"] == 12.0


class ValidatingModule(CountingModule):
    """:class:`CountingModule` with 3 validation batches; ``validations`` counts finished validations."""

    validations = 0

    def validation_step(self, batch, batch_idx):
        pass

    def on_validation_epoch_end(self):
        self.validations += 1

    def val_dataloader(self):
        inputs = torch.zeros(12, 8, dtype=torch.long)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, inputs), batch_size=4)


def test_validation_time_is_left_out_of_the_training_rates(monkeypatch):
    """Each validation takes 100 s on the clock: training still runs one step a second."""
    module = ValidatingModule()
    trainer = L.Trainer(max_steps=12, log_every_n_steps=4, val_check_interval=4, num_sanity_val_steps=0,
                        callbacks=[ModelFlopsThroughput()], logger=(logger := MetricsLogger()),
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                        accelerator="cpu")
    monkeypatch.setattr(throughput, "perf_counter", lambda: trainer.global_step + 100.0 * module.validations)
    trainer.fit(module)
    train = [metrics for _, metrics in logger.rows if "throughput/train/batches" in metrics]
    val = [metrics for _, metrics in logger.rows if "throughput/validate/batches" in metrics]
    assert [metrics["throughput/train/device/batches_per_sec"] for metrics in train] == pytest.approx([1.0] * 3)
    assert len(val) == 3 and all(metrics["throughput/validate/device/batches_per_sec"] == pytest.approx(3 / 100)
                                 for metrics in val)


def test_flops_per_batch_is_counted_once_per_shape(monkeypatch):
    module = tiny_module()
    module._trainer = SimpleNamespace(training=True)
    counted = []
    count = ModelConfig.flops_per_token
    monkeypatch.setattr(ModelConfig, "flops_per_token", lambda self, *a, **k: counted.append(a) or count(self, *a, **k))
    with torch.no_grad():
        for batch_size in (3, 3, 3, 2, 3):
            module.token_losses(random_batch(batch_size))
            assert module.flops_per_batch == pytest.approx(count(module.config, SEQ_LEN) * batch_size * SEQ_LEN)
    assert len(counted) == 2
    module.model.set_attention_override("full")  # the phase switch changes the count
    assert module.flops_per_batch == pytest.approx(
        count(module.config, SEQ_LEN, ["full", "full"]) * 3 * SEQ_LEN)
    assert len(counted) == 3


def test_grad_norm_is_computed_once_a_step_for_the_module_and_the_guard(monkeypatch):
    """The module logs it and the guard checks it: one total norm per optimizer step."""
    norms = []
    total_norm = torch.nn.utils.get_total_norm
    monkeypatch.setattr(torch.nn.utils, "get_total_norm", lambda grads, *a, **k: norms.append(
        total_norm(grads, *a, **k)) or norms[-1])
    module = tiny_module()
    logged = {}
    monkeypatch.setattr(module, "log", lambda name, value, **kwargs: logged.setdefault(name, []).append(value))
    batches = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*random_batch(6)), batch_size=2)
    trainer = L.Trainer(max_steps=3, callbacks=[DivergenceGuard()], logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, accelerator="cpu")
    trainer.fit(module, train_dataloaders=batches)
    assert len(norms) == 3
    assert [float(norm) for norm in logged["train/grad_norm"]] == [float(norm) for norm in norms]
