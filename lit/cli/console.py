"""The command's console: Lightning's banners, tips and known-harmless warnings left out.

Applied by the ``flexmoba`` command around a subcommand (:func:`quiet_console`), never at import:
a program that imports flexmoba or lit keeps Lightning's console as Lightning makes it.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings

# Lightning's info lines that say nothing the run's last line does not: the accelerator banner, the
# litlogger advertisement, the seed (it is in the saved config), the checkpoint loaded, why the fit stopped and
# that Ctrl-C was seen (the command's own line says where the run stopped and how to resume it).
BANNERS = re.compile(r"(GPU|TPU|HPU) available:|💡 Tip:|Seed set to \d+|Restoring states from the checkpoint|"
                     r"Loaded model weights from the checkpoint|`Trainer.fit` stopped:|"
                     r"`Trainer\(\w+=.*\)` was configured so|Detected KeyboardInterrupt, attempting graceful shutdown")
BANNER_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
                  "lightning.fabric.utilities.seed")

# Warnings that are known and harmless here, each with why.
HARMLESS_WARNINGS = (
    # Lightning's own pytree helper calls torch's deprecated LeafSpec check; nothing to do on our side.
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    # torch's notice on loading a checkpoint with weights_only=False (Lightning restoring a run's own);
    # flexmoba checkpoints hold plain data and load with weights_only=True as well.
    r"You are using `torch.load` with `weights_only=False`",
    # A resumed run writes into its own checkpoint folder on purpose.
    r"Checkpoint directory .* exists and is not empty",
    # A run's config is handed over as Python values, which is what this warning is about.
    r"LightningCLI's args parameter is intended",
    # The launcher resumes mid-epoch through the data module's own state (lit/training/data.py).
    r"You're resuming from a checkpoint that ended before the epoch ended",
    # Tiny and CPU runs: one worker is the right choice on a few cores.
    r"The '\w+_dataloader' does not have many workers",
    # max_steps ends the fit; the epoch count is meaningless then.
    r"`max_epochs` was not set",
)


class DropBanners(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not BANNERS.search(record.getMessage())


@contextlib.contextmanager
def quiet_console():
    """Inside: Lightning's banners and the harmless warnings above are not printed."""
    banner_filter = DropBanners()
    loggers = [logging.getLogger(name) for name in BANNER_LOGGERS]
    for logger in loggers:
        logger.addFilter(banner_filter)
    try:
        with warnings.catch_warnings():
            for message in HARMLESS_WARNINGS:
                warnings.filterwarnings("ignore", message=message)
            yield
    finally:
        for logger in loggers:
            logger.removeFilter(banner_filter)
