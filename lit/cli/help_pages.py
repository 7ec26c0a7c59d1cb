"""The help pages of the subcommands built by LightningCLI, kept as text so that ``flexmoba fit --help``
answers in a fraction of a second: building them imports Lightning and torch (seconds) to read the
Trainer's and the model's signatures.

    python -m lit.cli.help_pages          # rewrite lit/cli/help/*.txt after changing an option

A test builds each page afresh and compares it with the kept one, so a kept page is never stale on
``main``; ``flexmoba <subcommand> --help`` with anything else on the line builds the page live.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

FOLDER = Path(__file__).with_name("help")
KEPT = ("fit", "validate", "test", "predict", "compare", "continued-scaling")
COLUMNS = "100"  # the width the pages are kept at


def kept_page(name: str) -> str | None:
    """The kept help page of ``name``, or None (not a kept subcommand, or its file is missing)."""
    path = FOLDER / f"{name}.txt"
    return path.read_text(encoding="utf-8") if name in KEPT and path.is_file() else None


def built_page(name: str) -> str:
    """``flexmoba <name> --help`` built live, in a fresh interpreter at the kept width."""
    code = ("import sys; sys.argv = ['flexmoba']\nfrom lit.cli.main import run_subcommand\n"
            f"run_subcommand({name!r}, ['--help'], kept_help=False)")
    env = {**os.environ, "COLUMNS": COLUMNS, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode != 0 or not proc.stdout.startswith("usage: "):
        raise RuntimeError(f"flexmoba {name} --help failed: {proc.stderr[-2000:]}")
    return proc.stdout


def main() -> None:
    FOLDER.mkdir(exist_ok=True)
    for name in KEPT:
        (FOLDER / f"{name}.txt").write_text(built_page(name), encoding="utf-8")
        print(f"wrote {FOLDER / name}.txt")


if __name__ == "__main__":
    main()
