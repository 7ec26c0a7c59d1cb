"""The tuning profile: chosen by device kind, overridden for a block only, never changing a result."""

import threading

import pytest
import torch

from flexmoba import moba_attention
from flexmoba.tuning import PROFILES, Tuning, tuning_for, use_tuning

from strategies import random_inputs


def test_the_profile_follows_the_device_kind():
    assert tuning_for(torch.device("cpu")) is PROFILES["cpu"]
    assert tuning_for("cuda") is PROFILES["cuda"]
    assert tuning_for("meta") is PROFILES["cuda"]  # other accelerators: the GPU profile


def test_an_override_holds_for_its_block_on_every_device_and_then_ends():
    with use_tuning("cpu", few_scores=3) as tuning:
        assert tuning_for("cpu") is tuning is tuning_for("cuda")
        assert tuning.few_scores == 3 and tuning.pooled_maxima
        with use_tuning("cuda") as inner:
            assert tuning_for("cpu") is inner
        assert tuning_for("cpu") is tuning
    assert tuning_for("cpu") is PROFILES["cpu"]


def test_an_override_stays_in_its_thread():
    seen = []
    with use_tuning(Tuning(few_scores=1)):
        thread = threading.Thread(target=lambda: seen.append(tuning_for("cpu")))
        thread.start()
        thread.join()
    assert seen == [PROFILES["cpu"]]


def test_bad_profiles_and_fields_are_named():
    with pytest.raises(ValueError, match="^profile must be one of"), use_tuning("tpu"):
        pass
    with pytest.raises(TypeError, match="no_such_field"), use_tuning("cpu", no_such_field=1):
        pass


def test_every_profile_gives_the_same_attention():
    """Thresholds pick among exact paths: the GPU profile on CPU (no pooled maxima, unfused gather,
    one span) computes what the CPU profile does."""
    q, k, v = random_inputs(0, 2, 4, 2, 300, 16)
    ids = torch.tensor([[0] * 120 + [1] * 180, [0] * 300])
    outs = []
    for profile in PROFILES:
        with use_tuning(profile, few_scores=0), torch.no_grad():
            outs.append(moba_attention(q, k, v, chunk_size=16, top_k=3, backend="gather", document_ids=ids))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
