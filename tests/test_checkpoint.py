"""Checkpoints load with their model config, those written before MobaSpec included."""

import dataclasses

from flexmoba import MobaSpec
from flexmoba.checkpoint import checkpoint_config
from flexmoba.model import ModelConfig


def test_a_checkpoint_config_round_trips():
    config = ModelConfig(n_layers=2, moba=MobaSpec(64, 2, granularity=16, backend="sdpa"))
    assert checkpoint_config({"hyper_parameters": {"config": dataclasses.asdict(config)}}) == config


def test_a_checkpoint_with_the_flat_moba_fields_loads_as_one_spec():
    saved = {"n_layers": 2, "moba_chunk_size": 64, "moba_top_k": 2, "moba_granularity": 16, "moba_backend": "sdpa"}
    config = checkpoint_config({"config": saved})
    assert config.moba == MobaSpec(64, 2, granularity=16, backend="sdpa") and config.n_layers == 2
