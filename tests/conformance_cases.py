"""Where the official MoBA conformance vectors live (``../shared/conformance``) and how to load them."""

from pathlib import Path

import torch

CONFORMANCE_DIR = Path(__file__).resolve().parents[2] / "shared" / "conformance"
FILES = ("moba_naive_edge.pt", "moba_naive_random.pt")


def load_cases() -> list[dict]:
    """Every case of every file, or [] when the folder is absent (the tests then skip)."""
    if not CONFORMANCE_DIR.is_dir():
        return []
    return [case for name in FILES for case in torch.load(CONFORMANCE_DIR / name)]
