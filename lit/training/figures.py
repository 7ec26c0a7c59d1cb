"""Figures through matplotlib's object API: no ``pyplot``, no backend switch, nothing process-wide.

A ``Figure`` made here belongs to no pyplot figure manager, and ``savefig`` picks the canvas for the
file's format itself, so drawing leaves the caller's backend, ``rcParams`` and open figures as they were
(``tests/test_no_global_state.py`` draws every experiment's figure to check it).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["figure", "save"]


def figure(width: float, height: float):
    """A new ``matplotlib.figure.Figure`` of ``width`` x ``height`` inches."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height))


def save(fig, path: str | Path, dpi: int = 110) -> Path:
    """``fig`` laid out tight and written to ``path`` (the format from its suffix)."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    return Path(path)
