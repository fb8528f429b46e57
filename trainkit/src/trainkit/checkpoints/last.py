"""last.ckpt at every epoch's end, the checkpoint a restarted job resumes from after a whole epoch, and at the end
of training."""

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint


class LastCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint under a class of its own (defaults.yaml names the file `last`). Lightning lets a
    callback that the model returns from `configure_callbacks` replace the Trainer's callbacks of the same class:
    a model's own ModelCheckpoint (of its best epochs, say) took the place of this one, and a restarted job then
    resumed from an older checkpoint. A model's ModelCheckpoint now saves beside it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._trained_from: int | None = None  # the step this fit's training began at; None: it trained nothing

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._trained_from = trainer.global_step

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # A fit stopped by max_steps or max_time mid-epoch ends past its last save: last.ckpt holds the trained
        # weights all the same. A fit that trained nothing (its checkpoint had ended the run) leaves last.ckpt as it
        # is: saved again now, it would hold the loaders and generators of a run that never started.
        trained = self._trained_from is not None and trainer.global_step > self._trained_from
        if trained and not self._should_skip_saving_checkpoint(trainer):  # skipped where it saved at this step
            self._save_topk_checkpoint(trainer, self._monitor_candidates(trainer))
