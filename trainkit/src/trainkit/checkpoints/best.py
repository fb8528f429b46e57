"""The `best_checkpoint:` section: a checkpoint of the best epoch by a metric the model logs."""

from dataclasses import dataclass
from typing import Literal

from jsonargparse import Namespace
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from trainkit.run.config import configured

BEST_CHECKPOINT = "trainkit.checkpoints.best.BestCheckpoint"
MODEL_CHECKPOINTS = (BEST_CHECKPOINT, "lightning.pytorch.callbacks.ModelCheckpoint")
NOT_METRICS = ("epoch", "step")  # what ModelCheckpoint adds to the logged metrics


@dataclass
class BestCheckpointSettings:
    """The `best_checkpoint:` section of the config.

    Args:
        monitor: a metric the model logs with `self.log` (val/loss, val/acc, ...); null keeps no best checkpoint.
        mode: min or max: whether a lower or a higher value of the metric is better.
    """

    monitor: str | None = None
    mode: Literal["min", "max"] = "min"


def add_best_checkpoint(config: Namespace) -> None:
    """A ModelCheckpoint of the monitored metric, first among the callbacks: `ckpt_path: best` reads the first.

    Added to the config before the callbacks are built, so the run's saved config.yaml holds it; a config
    that already has it (a rerun of a saved one) gets no second."""
    settings = config.best_checkpoint
    if settings.monitor is None:
        return
    callbacks = configured(config.trainer.callbacks)
    for callback in callbacks:
        if callback.class_path in MODEL_CHECKPOINTS and callback.init_args.get("monitor") == settings.monitor:
            return
    init_args = Namespace(monitor=settings.monitor, mode=settings.mode, filename="best-{epoch}-{step}")
    config.trainer.callbacks = [Namespace(class_path=BEST_CHECKPOINT, init_args=init_args), *callbacks]


class BestCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint of the best epoch by `monitor`, except that a metric the model does not log
    costs no training. Lightning's raises at the end of the first epoch, before last.ckpt is saved: the epoch is
    lost, and so is a restarted job's. This one says so once, after the sanity check's validation (before the
    first training step) or else after the first validation, and keeps no best checkpoint while the metric is
    missing; the rest trains and saves."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._said_missing = False

    def on_sanity_check_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # With several validation loaders Lightning keeps none of the sanity check's metrics: the first
        # validation tells instead.
        several_loaders = len(trainer.num_sanity_val_batches) > 1
        if self.monitor is not None and self.monitor not in trainer.callback_metrics and not several_loaders:
            self._say_missing(trainer.callback_metrics, "validation logs")

    def _save_topk_checkpoint(self, trainer: Trainer, monitor_candidates: dict[str, Tensor]) -> None:
        if self.monitor is not None and self.monitor not in monitor_candidates:
            self._say_missing(monitor_candidates, "the model logs")
            return
        super()._save_topk_checkpoint(trainer, monitor_candidates)

    def _say_missing(self, metrics: dict[str, Tensor], logged_by: str) -> None:
        if self._said_missing:
            return
        self._said_missing = True
        logged = ", ".join(sorted(name for name in metrics if name not in NOT_METRICS)) or "no metric"
        rank_zero_warn(
            f"best_checkpoint.monitor: {logged_by} {logged}, not {self.monitor!r}: no best checkpoint is kept while"
            " it is missing (last.ckpt is). Set it to a metric the model logs, or null (configs/experiment.yaml)."
        )
