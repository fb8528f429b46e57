"""last.ckpt at every epoch's end, the checkpoint a restarted job resumes from after a whole epoch, and at the end
of training."""

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint


class LastCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint under a class of its own (defaults.yaml names the file `last`). Lightning lets a
    callback that the model returns from `configure_callbacks` replace the Trainer's callbacks of the same class:
    a model's own ModelCheckpoint (of its best epochs, say) took the place of this one, and a restarted job then
    resumed from an older checkpoint. A model's ModelCheckpoint now saves beside it."""

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # A fit can end past its last epoch's end: resumed from a checkpoint saved after the run's last step (a
        # SIGTERM there), it trains nothing and no epoch ends; stopped by max_steps or max_time mid-epoch. last.ckpt
        # then holds the trained weights all the same, and the preemption checkpoint can go.
        if not self._should_skip_saving_checkpoint(trainer):  # also where it saved at this step already
            self._save_topk_checkpoint(trainer, self._monitor_candidates(trainer))
