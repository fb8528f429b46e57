"""last.ckpt at every epoch's end, the checkpoint a restarted job resumes from after a whole epoch."""

from lightning.pytorch.callbacks import ModelCheckpoint


class LastCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint under a class of its own (defaults.yaml names the file `last`). Lightning lets a
    callback that the model returns from `configure_callbacks` replace the Trainer's callbacks of the same class:
    a model's own ModelCheckpoint (of its best epochs, say) took the place of this one, and a restarted job then
    resumed from an older checkpoint. A model's ModelCheckpoint now saves beside it."""
