"""Context parallelism under Lightning: a data-parallel x context-parallel device mesh.

``ContextParallelStrategy`` is Lightning's ``ModelParallelStrategy`` with the mesh
``("data_parallel", "context_parallel")`` of shape ``[world / n, n]``: ranks ``n d .. n d + n - 1``
form context-parallel group d, which holds the same sequences, each rank a contiguous slice
(:mod:`flexmoba.context_parallel`). LitLM shards the model with FSDP2 over all ranks (the
flattened mesh), so the gradients are averaged over every rank once; the data module gives
each data-parallel group its sequences and each rank its slice.

Reductions: a rank's loss for the backward is its share of its group's mean,
``local sum / group count``, times n because FSDP2 averages over all ``dp n`` ranks; the
logged loss is the group's mean. Evaluation gathers each group's per-token losses to whole
sequences and only its first rank updates the metrics, so every position counts once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.parallel import ParallelStrategy

from flexmoba.context_parallel import ContextParallel, sequence_slice

__all__ = ["ContextParallelStrategy", "MeshRanks", "SequenceSlice", "context_parallel_mesh", "mesh_ranks",
           "mesh_shape"]

MESH_DIMS = ("data_parallel", "context_parallel")


def mesh_shape(world_size: int, context_parallel_size: int) -> tuple[int, int]:
    """``(data_parallel_size, context_parallel_size)`` of a world; a clear error if it does not split."""
    if isinstance(context_parallel_size, bool) or not isinstance(context_parallel_size, int) \
            or context_parallel_size < 1:
        raise ValueError(f"context_parallel_size must be an int >= 1, got {context_parallel_size!r}")
    if world_size % context_parallel_size:
        raise ValueError(f"context_parallel_size={context_parallel_size} must divide the number of processes "
                         f"({world_size}); data_parallel_size is processes / context_parallel_size")
    return world_size // context_parallel_size, context_parallel_size


@dataclass(frozen=True)
class MeshRanks:
    """Where one process sits: data-parallel group ``dp_rank`` of ``dp_size``, rank ``cp_rank`` of ``cp_size`` in it."""

    dp_size: int
    dp_rank: int
    cp_size: int = 1
    cp_rank: int = 0

    @classmethod
    def of_rank(cls, global_rank: int, world_size: int, context_parallel_size: int) -> MeshRanks:
        """The position of ``global_rank`` in the row-major ``[dp, cp]`` mesh (``init_device_mesh``'s order)."""
        dp, cp = mesh_shape(world_size, context_parallel_size)
        return cls(dp, global_rank // cp, cp, global_rank % cp)

    def sequence_slice(self, seq_len: int) -> tuple[int, int]:
        return sequence_slice(seq_len, self.cp_rank, self.cp_size)


def context_parallel_mesh(world_size: int, context_parallel_size: int, device: torch.device):
    """The ``("data_parallel", "context_parallel")`` device mesh of this world."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, mesh_shape(world_size, context_parallel_size), mesh_dim_names=MESH_DIMS)


def mesh_ranks(trainer) -> MeshRanks:
    """This process's :class:`MeshRanks` under ``trainer``'s strategy (plain data parallelism
    over the default group unless the strategy has a context-parallel mesh)."""
    mesh = getattr(getattr(trainer, "strategy", None), "_device_mesh", None)
    if mesh is not None and mesh.mesh_dim_names == MESH_DIMS:
        dp, cp = mesh["data_parallel"], mesh["context_parallel"]
        return MeshRanks(dp.size(), dp.get_local_rank(), cp.size(), cp.get_local_rank())
    if dist.is_available() and dist.is_initialized():
        return MeshRanks(dist.get_world_size(), dist.get_rank())
    return MeshRanks(1, 0)


def context_parallel_group(mesh) -> ContextParallel | None:
    """The model's :class:`flexmoba.context_parallel.ContextParallel` of a context-parallel mesh (None otherwise)."""
    if mesh is None or mesh.mesh_dim_names != MESH_DIMS:
        return None
    cp = mesh["context_parallel"]
    return ContextParallel(cp.get_local_rank(), cp.size(), cp.get_group())


def group_sum(x: torch.Tensor, cp: ContextParallel | None) -> torch.Tensor:
    """``x`` summed over ``cp``'s group (no gradient); ``x`` itself without one."""
    if cp is None:
        return x
    total = x.detach().clone()
    dist.all_reduce(total, group=cp.group)
    return total


def gather_positions(x: torch.Tensor, cp: ContextParallel | None) -> torch.Tensor:
    """``[B, S / n]`` slices of the group -> ``[B, S]`` whole sequences (no gradient)."""
    if cp is None:
        return x
    parts = [torch.empty_like(x) for _ in range(cp.size)]
    dist.all_gather(parts, x.detach().contiguous(), group=cp.group)
    return torch.cat(parts, 1)


class SequenceSlice:
    """A collate function: batch the ``(inputs, targets)`` pairs, keep positions ``[start, stop)``."""

    def __init__(self, start: int, stop: int):
        self.start, self.stop = start, stop

    def __call__(self, samples):
        from torch.utils.data import default_collate

        return [x[:, self.start:self.stop] for x in default_collate(samples)]


class ContextParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` over a ``("data_parallel", "context_parallel")`` mesh.

    Args:
        context_parallel_size: ranks that share each sequence (each holds ``seq_len / n``
            positions); must divide the number of processes.
        save_distributed_checkpoint, process_group_backend, timeout: as ``ModelParallelStrategy``.
    """

    def __init__(self, context_parallel_size: int = 1, save_distributed_checkpoint: bool = False,
                 process_group_backend: str | None = None, timeout=None, **kwargs):
        mesh_shape(context_parallel_size, context_parallel_size)  # checks the type early
        extra = {} if timeout is None else {"timeout": timeout}
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, **extra, **kwargs)
        self.context_parallel_size = context_parallel_size

    def setup_environment(self) -> None:
        ParallelStrategy.setup_environment(self)  # not ModelParallelStrategy's: it builds a (data, tensor) mesh
        self._setup_distributed()
        self._device_mesh = context_parallel_mesh(self.world_size, self.context_parallel_size, self.root_device)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh
