"""Scale-out switches: FSDP2 under Lightning's ModelParallelStrategy (the sharding itself, and
2 processes == 1 process), activation checkpointing per block and torch.compile of the model
(each trains like the plain model).

Multi-process runs are CLI subprocesses under torchrun: Lightning's own launcher would re-run
pytest in the second rank.
"""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from flexmoba.model import ModelConfig
from lit.training.module import LitLM

REPO = Path(__file__).resolve().parents[3]
CONFIGS = REPO / "configs"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


@pytest.fixture
def one_process_group(tmp_path):
    """A world of one gloo process, so a device mesh can be built inside pytest."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def tiny_module(**kwargs) -> LitLM:
    return LitLM(ModelConfig(n_layers=2, d_model=32, n_heads=2, n_kv_heads=1), seq_len=64, position_window=32,
                 trailing_window=32, **kwargs)


def test_configure_model_shards_each_block_then_the_root(one_process_group):
    unsharded = tiny_module()
    unsharded.configure_model()  # no mesh (single device, DDP): nothing to shard
    assert not any(isinstance(m, FSDPModule) for m in unsharded.modules())

    module = tiny_module()
    module._device_mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    module.configure_model()
    assert isinstance(module.model, FSDPModule)
    assert all(isinstance(block, FSDPModule) for block in module.model.blocks)
    assert isinstance(module.model.blocks[0].attn.wq.weight, DTensor)  # parameters are sharded
    module.configure_model()  # Lightning calls it again for every stage: a second call changes nothing
    assert sum(isinstance(m, FSDPModule) for m in module.modules()) == 1 + len(module.model.blocks)
    tokens = torch.randint(0, 256, (2, 64))
    assert module(tokens).shape == (2, 64, 256)


def fit(root: Path, cache: Path, *extra: str, launcher: list[str]) -> None:
    args = ["--config", str(CONFIGS / "moba.yaml"), "--config", str(CONFIGS / "tiny.yaml"),
            "--trainer.default_root_dir", str(root), "--data.cache_dir", str(cache),
            "--trainer.enable_progress_bar", "false", "--trainer.accelerator", "cpu", *extra]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*launcher, "-m", "lit.cli.lightning_cli", "fit", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def logged(root: Path, name: str) -> dict[int, float]:
    with open(root / "csv" / "version_0" / "metrics.csv") as f:
        return {int(r["step"]): float(r[name]) for r in csv.DictReader(f) if r.get(name)}


@pytest.mark.slow
def test_fsdp2_two_processes_train_like_one(tmp_path, corpus_cache):
    """Same global batch (4 = 2 x 2): the gradient norm of every step and the validation losses
    agree to fp32 noise. (train/loss is each rank's own half of the batch, so it is not compared.)"""
    fit(tmp_path / "one", corpus_cache, "--data.batch_size", "4", launcher=[sys.executable])
    fit(tmp_path / "two", corpus_cache, "--config", str(CONFIGS / "fsdp2.yaml"), "--trainer.devices", "2",
        "--data.batch_size", "2", launcher=TORCHRUN)
    for name in ("train/grad_norm", "val/loss"):
        one, two = logged(tmp_path / "one", name), logged(tmp_path / "two", name)
        assert len(one) >= 2 and sorted(one) == sorted(two), name
        for step, value in one.items():
            assert two[step] == pytest.approx(value, rel=1e-5), (name, step)
    assert (tmp_path / "two" / "checkpoints" / "last.ckpt").is_file()  # one full checkpoint, loadable as any


def attention_calls_in_one_step(module: LitLM) -> int:
    """Forward calls of the blocks' attention in one forward and backward."""
    calls = []
    for block in module.model.blocks:
        block.attn.register_forward_hook(lambda *_: calls.append(1))
    module(torch.randint(0, 256, (2, 64))).float().pow(2).mean().backward()
    return len(calls)


def test_activation_checkpointing_recomputes_each_block_in_the_backward():
    plain, checkpointed = tiny_module(), tiny_module(activation_checkpointing=True)
    for module in (plain, checkpointed):
        module.configure_model()
        forwards = [block.forward for block in module.model.blocks]
        module.configure_model()  # Lightning calls it for every stage: it must not wrap again
        assert [block.forward for block in module.model.blocks] == forwards
    assert attention_calls_in_one_step(plain) == 2  # two blocks
    assert attention_calls_in_one_step(checkpointed) == 4  # each runs again in the backward


def test_compile_switch_compiles_the_model_in_place():
    module = tiny_module(compile=True)
    names = set(module.state_dict())
    module.configure_model()
    assert module.model._compiled_call_impl is not None
    assert set(module.state_dict()) == names  # checkpoints keep the plain model's names


@pytest.mark.slow
def test_activation_checkpointing_and_compile_train_like_the_plain_model(tmp_path, corpus_cache):
    fit(tmp_path / "plain", corpus_cache, launcher=[sys.executable])
    for switch in ("activation_checkpointing", "compile"):
        fit(tmp_path / switch, corpus_cache, f"--model.{switch}", "true", launcher=[sys.executable])
        for name in ("train/loss", "train/grad_norm", "val/loss"):
            plain, switched = logged(tmp_path / "plain", name), logged(tmp_path / switch, name)
            assert len(plain) >= 2 and sorted(plain) == sorted(switched), (switch, name)
            for step, value in plain.items():
                assert switched[step] == pytest.approx(value, rel=1e-5), (switch, name, step)
