"""``flexmoba`` command line: LightningCLI over :class:`LitLM` and any LightningDataModule.

``data`` defaults to :class:`PythonSourceData`, whose arguments a config may give directly
(``data: {seq_len: 1024}``); another module is named by ``data.class_path`` (e.g.
``lit.retrieval.RetrievalData``, see ``configs/retrieval/``). Every data module must take
``seq_len``, which is linked to ``model.seq_len``.

    flexmoba fit --config configs/moba.yaml
    flexmoba fit --config configs/moba.yaml --config configs/tiny.yaml --trainer.max_steps 20
    flexmoba validate --config configs/moba.yaml --ckpt_path last
    flexmoba fit --config configs/full.yaml --trainer.strategy ddp --trainer.devices 2 --trainer.accelerator cpu

Checkpoints go to ``<trainer.default_root_dir>/checkpoints`` (``last.ckpt`` kept), so
``--ckpt_path last`` resumes or evaluates the latest one. Logs: CSV under
``<root>/csv/version_*/metrics.csv`` and TensorBoard under ``<root>/tb``.
"""

from __future__ import annotations

import os
import warnings

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lit.data import PythonSourceData
from lit.module import LitLM

# PythonSourceData resumes mid-epoch through its own state_dict (see lit/data.py); Lightning's
# check only looks at the DataLoader, so its warning would be wrong here.
warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")


def checkpoint_dir(default_root_dir: str | None) -> str:
    return os.path.join(default_root_dir or os.getcwd(), "checkpoints")


def default_loggers(root: str) -> list:
    return [CSVLogger(root, name="csv"), TensorBoardLogger(root, name="tb")]


class FlexMobaCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults({
            "checkpoint.save_last": True,
            "checkpoint.filename": "step{step:06d}",
            "checkpoint.auto_insert_metric_name": False,
            "checkpoint.save_top_k": 1,
        })
        parser.link_arguments("trainer.default_root_dir", "checkpoint.dirpath", compute_fn=checkpoint_dir)
        # Subclass mode with a default class: old configs' bare ``data:`` arguments still apply to it.
        parser.set_defaults({"data": {"class_path": f"{PythonSourceData.__module__}.{PythonSourceData.__name__}"}})
        parser.link_arguments("data.init_args.seq_len", "model.seq_len")

    def instantiate_trainer(self, **kwargs):
        trainer_config = self._get(self.config_init, "trainer", default={})
        if trainer_config.get("logger") in (None, True) and "logger" not in kwargs:
            kwargs["logger"] = default_loggers(trainer_config.get("default_root_dir") or os.getcwd())
        return super().instantiate_trainer(**kwargs)


def run_cli(args: list[str] | None = None) -> FlexMobaCLI:
    """Run the CLI (in-process when ``args`` are given) and return it, trainer and model included."""
    return FlexMobaCLI(
        LitLM,
        L.LightningDataModule,
        subclass_mode_data=True,
        args=args,
        seed_everything_default=1337,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"description": "Train and evaluate MoBA / full-attention byte-level LMs (see configs/)."},
    )


def main() -> None:
    run_cli()


if __name__ == "__main__":
    main()
