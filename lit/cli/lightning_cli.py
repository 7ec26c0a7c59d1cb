"""``flexmoba fit | validate | test | predict``: LightningCLI over :class:`lit.training.module.LitLM`.

    flexmoba fit --config configs/moba.yaml
    flexmoba fit --config configs/moba.yaml --config configs/tiny.yaml --trainer.max_steps 20
    flexmoba validate --config configs/moba.yaml --ckpt_path last
    flexmoba fit --config configs/full.yaml --trainer.strategy ddp --trainer.devices 2 --trainer.accelerator cpu

The run is built by the one launcher (:mod:`lit.training.launch`); a diverging run stops
with one line and exit code 1, a mistake with one line and exit code 2 (:mod:`lit.cli.errors`).
"""

from __future__ import annotations

import sys

from lit.cli.errors import command_scope


def main(args: list[str] | None = None) -> None:
    """Run ``args`` (default: this process's command line) as ``flexmoba fit | validate | test | predict``."""
    command = ["flexmoba", *(sys.argv[1:] if args is None else args)]
    with command_scope(command):
        from lit.training.launch import run_cli

        run_cli(args)


if __name__ == "__main__":
    main()
