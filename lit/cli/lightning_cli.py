"""``flexmoba fit | validate | test | predict``: LightningCLI over :class:`lit.training.module.LitLM`.

    flexmoba fit --config configs/moba.yaml
    flexmoba fit --config configs/moba.yaml --config configs/tiny.yaml --trainer.max_steps 20
    flexmoba validate --config configs/moba.yaml --ckpt_path last
    flexmoba fit --config configs/full.yaml --trainer.strategy ddp --trainer.devices 2 --trainer.accelerator cpu

The run is built by the one launcher (:mod:`lit.training.launch`); a diverging run stops
with one line and exit code 1 (:func:`lit.cli.errors.exit_on_divergence`).
"""

from __future__ import annotations

from lit.cli.errors import exit_on_divergence


def main() -> None:
    from lit.training.launch import run_cli

    with exit_on_divergence():
        run_cli()


if __name__ == "__main__":
    main()
