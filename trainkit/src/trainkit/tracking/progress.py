"""Progress as plain log lines, for runs whose output goes to a file (clusters) instead of a terminal."""

import logging
import math
import time
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor

log = logging.getLogger(__name__)


class PlainProgress(Callback):
    """After every `every_n_steps`-th optimizer step, and after each validation, rank 0 logs one line.

    The command line uses this instead of the progress bar when output is not a terminal, where a bar's
    redraws would fill the log file. Steps are counted over the whole run, as the logger counts them, so
    each line shows the loss the logger records for that step; with gradient accumulation a line shows the
    batch in the epoch and the optimizer step (the step checkpoints and the `SIGTERM:` line name). Metrics
    go by when they were logged, whatever their names: the validation line shows those validation logged,
    the training lines the others.
    """

    def __init__(self, every_n_steps: int = 50) -> None:
        self.every_n_steps = every_n_steps
        # When, and after which optimizer step, the rate was last measured.
        self._since_time = time.monotonic()
        self._since_step = 0
        self._validation_start = 0.0
        self._before_validation: dict[str, Tensor] = {}
        self._validation_names: set[str] = set()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # From the checkpoint's step in a resumed run. Then over every step since the last line, across epochs:
        # validation's time is taken out as it ends (below).
        self._since_time = time.monotonic()
        self._since_step = trainer.global_step

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        step = trainer.global_step  # this batch's optimizer step included
        if not trainer.is_global_zero or step % self.every_n_steps or step == self._since_step:
            return  # step == self._since_step: an accumulating batch, no new optimizer step
        now = time.monotonic()
        rate = (step - self._since_step) / (now - self._since_time)
        self._since_time, self._since_step = now, step
        batch = trainer.fit_loop.epoch_loop.batch_progress.current.completed + 1
        in_epoch = f"{batch}{_out_of(trainer.num_training_batches)}"
        # An epoch's length counts batches; a checkpoint's step counts optimizer steps.
        position = f"batch {in_epoch} (step {step})" if trainer.accumulate_grad_batches > 1 else f"step {in_epoch}"
        where = f"{_epoch(trainer)} {position}"
        training = {name: value for name, value in trainer.callback_metrics.items()
                    if name not in self._validation_names}  # fmt: skip
        log.info(f"{where} {_shown(training)} ({rate:.1f} steps/s)")

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._validation_start = time.monotonic()
        self._before_validation = dict(trainer.callback_metrics)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._since_time += time.monotonic() - self._validation_start  # a validation mid-epoch is not training time
        if not trainer.is_global_zero or trainer.sanity_checking:
            return
        # What validation logged is new, or replaced what was there before it.
        logged = {name: value for name, value in trainer.callback_metrics.items()
                  if self._before_validation.get(name) is not value}  # fmt: skip
        self._validation_names.update(logged)
        # `validate` restores a checkpoint's weights, not its epoch: the line names the subcommand instead.
        fitting = trainer.state.fn == TrainerFn.FITTING
        log.info(f"{_epoch(trainer) if fitting else trainer.state.fn.value} {_shown(logged)}")


def _epoch(trainer: Trainer) -> str:
    endless = trainer.max_epochs is None or trainer.max_epochs < 0  # a run bounded by max_steps or time
    return f"epoch {trainer.current_epoch + 1}{'' if endless else _out_of(trainer.max_epochs)}"


def _out_of(total: float) -> str:
    return f"/{total}" if math.isfinite(total) else ""  # a loader of unknown length has an infinite total


def _shown(metrics: dict[str, Tensor]) -> str:
    """`name=value` of each single number, without the per-step and per-epoch copies of one logged both ways."""
    return " ".join(
        f"{name}={value.item():.4f}"
        for name, value in sorted(metrics.items())
        if value.numel() == 1 and not _a_copy(name, metrics)
    )


def _a_copy(name: str, metrics: dict[str, Tensor]) -> bool:
    return any(name.endswith(suffix) and name.removesuffix(suffix) in metrics for suffix in ("_step", "_epoch"))
