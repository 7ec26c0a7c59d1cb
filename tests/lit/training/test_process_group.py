"""A command's process group is destroyed when the command ends, on success and on failure."""

import pytest
import torch.distributed as dist

from lit.training.process_group import process_group_destroyed_at_end


def init_gloo(tmp_path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)


def test_the_process_group_a_command_made_is_destroyed_when_it_ends(tmp_path):
    with process_group_destroyed_at_end():
        init_gloo(tmp_path)
        assert dist.is_initialized()
    assert not dist.is_initialized()


def test_the_process_group_is_destroyed_when_the_command_fails(tmp_path):
    with pytest.raises(RuntimeError, match="the command failed"), process_group_destroyed_at_end():
        init_gloo(tmp_path)
        raise RuntimeError("the command failed")
    assert not dist.is_initialized()


def test_a_command_without_a_process_group_ends_as_it_was():
    with process_group_destroyed_at_end():
        pass
    assert not dist.is_initialized()
