"""The `best_checkpoint:` section: a checkpoint of the best epoch by a metric the model logs."""

from dataclasses import dataclass
from typing import Literal

from jsonargparse import Namespace

from trainkit.run.config import configured

MODEL_CHECKPOINT = "lightning.pytorch.callbacks.ModelCheckpoint"


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
        if callback.class_path == MODEL_CHECKPOINT and callback.init_args.get("monitor") == settings.monitor:
            return
    init_args = Namespace(monitor=settings.monitor, mode=settings.mode, filename="best-{epoch}-{step}")
    config.trainer.callbacks = [Namespace(class_path=MODEL_CHECKPOINT, init_args=init_args), *callbacks]
