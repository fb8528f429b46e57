"""Progress as plain log lines, for runs whose output goes to a file (clusters) instead of a terminal."""

import logging
import time
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

log = logging.getLogger(__name__)


class PlainProgress(Callback):
    """Every `every_n_steps` training steps, and after each validation, rank 0 logs one line.

    The command line uses this instead of the progress bar when output is not a terminal,
    where a bar's redraws would fill the log file.
    """

    def __init__(self, every_n_steps: int = 50) -> None:
        self.every_n_steps = every_n_steps
        self._since = time.monotonic()

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._since = time.monotonic()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        step_in_epoch = trainer.fit_loop.epoch_loop.batch_progress.current.completed + 1
        if not trainer.is_global_zero or step_in_epoch % self.every_n_steps:
            return
        rate = self.every_n_steps / (time.monotonic() - self._since)
        self._since = time.monotonic()
        epoch = f"epoch {trainer.current_epoch + 1}/{trainer.max_epochs}"
        step = f"step {step_in_epoch}/{trainer.num_training_batches}"
        log.info(f"{epoch} {step} {_metrics(trainer, 'train/')} ({rate:.1f} steps/s)")

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.is_global_zero and not trainer.sanity_checking:
            log.info(f"epoch {trainer.current_epoch + 1}/{trainer.max_epochs} {_metrics(trainer, 'val/')}")


def _metrics(trainer: Trainer, prefix: str) -> str:
    return " ".join(
        f"{name}={value.item():.4f}"
        for name, value in sorted(trainer.callback_metrics.items())
        if name.startswith(prefix) and not name.endswith("_epoch") and value.numel() == 1
    )
