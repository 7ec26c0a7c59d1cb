"""Context parallelism under Lightning: the data x context mesh (ranks, slices, reductions) in one
process, and ``flexmoba fit`` under torchrun with 2 gloo processes (context parallelism 2, and
data parallelism 2 x context parallelism 1) against the same fit in 1 process.
"""

import sys

import pytest
import torch
import torch.distributed as dist
from test_distributed import CONFIGS, TORCHRUN, fit, logged

from lit.training.context_parallel import (
    MESH_DIMS,
    MeshRanks,
    SequenceSlice,
    context_parallel_mesh,
    mesh_ranks,
    mesh_shape,
)
from lit.training.data import EvalSampler, ResumableSampler
from lit.training.metrics import IGNORE_INDEX


def test_ranks_sit_row_major_in_the_mesh():
    ranks = [MeshRanks.of_rank(r, 4, 2) for r in range(4)]
    assert [(m.dp_rank, m.cp_rank) for m in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [m.sequence_slice(128) for m in ranks] == [(0, 64), (64, 128)] * 2
    assert mesh_shape(8, 4) == (2, 4) and mesh_shape(3, 1) == (3, 1)


def test_a_context_parallel_group_loads_the_same_sequences_and_groups_load_different_ones():
    dataset = list(range(10))
    ranks = [MeshRanks.of_rank(r, 4, 2) for r in range(4)]
    train = [list(ResumableSampler(dataset, shuffle=True, seed=0, ranks=m)) for m in ranks]
    evaluate = [list(EvalSampler(dataset, m)) for m in ranks]
    for shards in (train, evaluate):
        assert shards[0] == shards[1] and shards[2] == shards[3]
        assert not set(shards[0]) & set(shards[2])


def test_each_rank_collates_its_slice_of_every_sequence():
    samples = [(torch.arange(8) + 10 * i, torch.arange(8) + 100 * i) for i in range(3)]
    inputs, targets = SequenceSlice(4, 8)(samples)
    assert inputs.shape == (3, 4) and torch.equal(inputs[1], torch.arange(4, 8) + 10)
    assert torch.equal(targets[2], torch.arange(4, 8) + 200)


def test_rank_losses_averaged_over_the_mesh_are_the_whole_batch_mean():
    """What LitLM.training_step hands each rank's backward: its share of its group's mean, times
    the group size; FSDP2's average over all dp x cp ranks is then the mean over the data-parallel
    groups' whole sequences (the 1-process loss when they hold as many targets)."""
    gen = torch.Generator().manual_seed(0)
    token_loss = torch.rand(4, 16, generator=gen)  # 2 groups x 2 sequences, 16 positions
    targets = torch.randint(0, 5, (4, 16), generator=gen)
    targets[0, 11:] = targets[3, 13:] = IGNORE_INDEX  # padding, on one rank of a group only
    dp, cp = 2, 2
    shares = []
    for rank in range(4):
        m = MeshRanks.of_rank(rank, 4, cp)
        rows, (start, stop) = slice(2 * m.dp_rank, 2 * m.dp_rank + 2), m.sequence_slice(16)
        group_count = (targets[rows] != IGNORE_INDEX).sum()
        local = torch.where(targets[rows, start:stop] != IGNORE_INDEX, token_loss[rows, start:stop], 0)
        shares.append(local.sum() / group_count * cp)
    group_means = [torch.where(targets[r] != IGNORE_INDEX, token_loss[r], 0).sum() / (targets[r] != IGNORE_INDEX).sum()
                   for r in (slice(0, 2), slice(2, 4))]
    torch.testing.assert_close(sum(shares) / (dp * cp), sum(group_means) / dp)


def test_context_parallel_size_must_divide_the_world():
    with pytest.raises(ValueError, match=r"^context_parallel_size=3 must divide the number of processes \(4\)"):
        mesh_shape(4, 3)
    with pytest.raises(ValueError, match="context_parallel_size must be an int >= 1"):
        mesh_shape(4, 0)


def test_sequence_length_must_divide_by_the_group():
    with pytest.raises(ValueError, match=r"^seq_len=129 must be divisible by context_parallel_size=2"):
        MeshRanks(1, 0, 2, 0).sequence_slice(129)


def test_the_mesh_of_one_process(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = context_parallel_mesh(1, 1, torch.device("cpu"))
        assert mesh.mesh_dim_names == MESH_DIMS

        class Strategy:
            _device_mesh = mesh

        class Trainer:
            strategy = Strategy()

        assert mesh_ranks(Trainer()) == MeshRanks(1, 0, 1, 0)
    finally:
        dist.destroy_process_group()


FIVE_STEPS = ["--trainer.max_steps", "5", "--trainer.val_check_interval", "5",
              "--model.config.full_attention_last_n_layers", "1"]  # one MoBA layer, one full
WINDOWS = ["val/loss", "val/loss_pos_000000_000032", "val/loss_pos_000096_000128", "val/loss_trailing"]


def assert_same_logs(one, other, names):
    for name in names:
        a, b = logged(one, name), logged(other, name)
        assert len(a) >= 1 and sorted(a) == sorted(b), name
        for step, value in a.items():
            assert b[step] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, step)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gather", "sdpa"])
def test_context_parallel_2_fits_like_one_process(tmp_path, corpus_cache, backend):
    """Every step's loss and gradient norm, and the final validation windows."""
    options = [*FIVE_STEPS, "--model.config.moba.backend", backend]
    fit(tmp_path / "one", corpus_cache, *options, launcher=[sys.executable])
    fit(tmp_path / "cp2", corpus_cache, *options, "--config", str(CONFIGS / "cp2.yaml"), "--trainer.devices", "2",
        launcher=TORCHRUN)
    assert len(logged(tmp_path / "one", "train/loss")) == 5
    assert_same_logs(tmp_path / "one", tmp_path / "cp2", ["train/loss", "train/grad_norm", *WINDOWS])


@pytest.mark.slow
def test_data_parallel_2_by_context_parallel_1_fits_like_one_process(tmp_path, corpus_cache):
    """The same global batch (4 = 2 x 2); the logged loss is the mean over the data-parallel groups."""
    fit(tmp_path / "one", corpus_cache, *FIVE_STEPS, "--data.batch_size", "4", launcher=[sys.executable])
    fit(tmp_path / "dp2", corpus_cache, *FIVE_STEPS, "--config", str(CONFIGS / "cp2.yaml"), "--trainer.devices", "2",
        "--trainer.strategy.init_args.context_parallel_size", "1", "--data.batch_size", "2", launcher=TORCHRUN)
    assert_same_logs(tmp_path / "one", tmp_path / "dp2", ["train/loss", "train/grad_norm", *WINDOWS])


@pytest.mark.slow
def test_context_parallel_size_that_does_not_divide_the_world_fails_with_one_line(tmp_path, corpus_cache):
    with pytest.raises(AssertionError, match="context_parallel_size=2 must divide the number of processes"):
        fit(tmp_path / "bad", corpus_cache, "--config", str(CONFIGS / "cp2.yaml"), launcher=[sys.executable])
