"""A validation interval longer than the epoch of a training loader with no length: validation would never run.

With `check_val_every_n_epoch` set (Lightning's default, 1), Lightning counts an int
`val_check_interval` in batches of each epoch. It refuses one longer than the epoch of a loader with
a length as the fit starts (one line, exit 2: run/config_errors.py), but a loader with no length (a
stream) gives its epoch's length only once the epoch ends: then validation never runs, and nothing
that waits on its scores (the best checkpoint, EarlyStopping, a ReduceLROnPlateau) either, without a word.
"""

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.model_helpers import is_overridden

from trainkit.run.errors import ConfigError


class RefuseAValidationIntervalLongerThanTheEpoch(Callback):
    """End the run with a ConfigError once an epoch of a training loader with no length ended before
    `val_check_interval`: at the end of the first epoch, the least training lost (Lightning's checkpoints save after
    validation with such an interval, so none was written)."""

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        progress = trainer.fit_loop.epoch_loop.batch_progress
        batches = progress.current.ready
        if not (progress.is_last_batch and never_validates(trainer, pl_module, batches)):
            return
        raise ConfigError(
            f"trainer.val_check_interval {trainer.val_check_interval} is more batches than an epoch of the training"
            f" loader gives ({batches}; it has no length, so this shows only once an epoch ended): with"
            f" trainer.check_val_every_n_epoch {trainer.check_val_every_n_epoch} validation never runs. Set"
            f" val_check_interval to at most {batches}, or check_val_every_n_epoch null to count batches across epochs"
        )


def never_validates(trainer: Trainer, pl_module: LightningModule, epoch_batches: int) -> bool:
    """Whether validation counted within each epoch of this many batches, over a loader with no length, never runs."""
    return (
        isinstance(trainer.val_check_interval, int)
        and trainer.check_val_every_n_epoch is not None
        and trainer.num_training_batches == float("inf")
        and epoch_batches < trainer.val_check_batch
        and is_overridden("validation_step", pl_module)
        and trainer.limit_val_batches != 0
    )
