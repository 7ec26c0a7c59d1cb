"""Where the official MoBA conformance vectors live (``tests/data/conformance``) and how to load them.

They ship with the repository (see the README there for their origin and checksums), so the
conformance tests run in any checkout. Should they be missing, their tests skip; CI sets
``FLEXMOBA_REQUIRE_CONFORMANCE=1`` (see ``.ci/run``), and then missing or incomplete vectors
fail the run instead.
"""

import os
from pathlib import Path

import pytest
import torch

CONFORMANCE_DIR = Path(__file__).resolve().parent / "data" / "conformance"
FILES = ("moba_naive_edge.pt", "moba_naive_random.pt")
N_CASES = 44  # 14 edge cases + 30 random ones
REQUIRE_ENV = "FLEXMOBA_REQUIRE_CONFORMANCE"


def required() -> bool:
    """Whether missing vectors are an error (CI) rather than a skip (a checkout without them)."""
    return os.environ.get(REQUIRE_ENV, "") not in ("", "0")


def missing_files() -> list[str]:
    return [name for name in FILES if not (CONFORMANCE_DIR / name).is_file()]


def require_vectors() -> Path:
    """The vectors' folder; skip without them, or fail when :func:`required`."""
    missing = missing_files()
    if missing:
        message = f"official MoBA conformance vectors {missing} not found in {CONFORMANCE_DIR}"
        if required():
            pytest.fail(f"{message}, and {REQUIRE_ENV}=1 requires them")
        pytest.skip(message)
    return CONFORMANCE_DIR


def load_cases() -> list[dict]:
    """Every case of every file present ([] when none is; the tests then skip or fail)."""
    return [case for name in FILES if (CONFORMANCE_DIR / name).is_file()
            for case in torch.load(CONFORMANCE_DIR / name)]
