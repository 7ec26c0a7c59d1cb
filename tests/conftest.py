import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

# CI profile: derandomized (same examples every run) and bounded in size.
settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile("dev", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

from conformance_cases import require_vectors  # noqa: E402 (after the profile is loaded)


@pytest.fixture(scope="session")
def conformance_dir() -> Path:
    """The vectors' folder: skips without them, fails instead under ``FLEXMOBA_REQUIRE_CONFORMANCE=1`` (CI)."""
    return require_vectors()


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny models: ~100x faster than two contending ones on a busy CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
