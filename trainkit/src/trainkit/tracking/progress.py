"""Progress as plain log lines, for runs whose output goes to a file (clusters) instead of a terminal."""

import logging
import time
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

log = logging.getLogger(__name__)


class PlainProgress(Callback):
    """After every `every_n_steps`-th optimizer step, and after each validation, rank 0 logs one line.

    The command line uses this instead of the progress bar when output is not a terminal,
    where a bar's redraws would fill the log file. Steps are counted over the whole run, as the
    logger counts them, so each line shows the loss the logger records for that step.
    """

    def __init__(self, every_n_steps: int = 50) -> None:
        self.every_n_steps = every_n_steps
        # When, and after which optimizer step, the rate was last measured.
        self._since_time = time.monotonic()
        self._since_step = 0

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Validation is not training time.
        self._since_time = time.monotonic()
        self._since_step = trainer.global_step

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        step = trainer.global_step  # this batch's optimizer step included
        if not trainer.is_global_zero or step % self.every_n_steps or step == self._since_step:
            return  # step == self._since_step: an accumulating batch, no new optimizer step
        now = time.monotonic()
        rate = (step - self._since_step) / (now - self._since_time)
        self._since_time, self._since_step = now, step
        epoch = f"epoch {trainer.current_epoch + 1}/{trainer.max_epochs}"
        step_in_epoch = trainer.fit_loop.epoch_loop.batch_progress.current.completed + 1
        where = f"{epoch} step {step_in_epoch}/{trainer.num_training_batches}"
        log.info(f"{where} {_metrics(trainer, 'train/')} ({rate:.1f} steps/s)")

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.is_global_zero and not trainer.sanity_checking:
            log.info(f"epoch {trainer.current_epoch + 1}/{trainer.max_epochs} {_metrics(trainer, 'val/')}")


def _metrics(trainer: Trainer, prefix: str) -> str:
    return " ".join(
        f"{name}={value.item():.4f}"
        for name, value in sorted(trainer.callback_metrics.items())
        if name.startswith(prefix) and not name.endswith("_epoch") and value.numel() == 1
    )
