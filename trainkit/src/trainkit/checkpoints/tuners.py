"""Lightning's tuners tune a run's first start only; a resumed fit goes on with what they found.

`LearningRateFinder` and `BatchSizeFinder`, as callbacks, tune at the start of every fit: they save the
training state, train some steps with other learning rates or batch sizes, and load that state back. In a
fit that resumes from a checkpoint they save it before the checkpoint's training state is loaded, so what
they load back starts the epoch and step counts over from 0 with a fresh optimizer: a resumed run trains
every epoch again, and a job resumed after each preemption would never end. Lightning has no setting to
tune only once, so a fit that resumes from a checkpoint in which something was trained runs without them.
What they found comes from the checkpoint: the learning rate with the optimizer's state, the batch size
from what this callback saves.
"""

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_setattr

KEY = "batch_sizes_found"  # {attribute name: batch size} in each checkpoint of a run with a BatchSizeFinder


class ResumeWhatTunersFound(Callback):
    """Leave Lightning's tuners out of a fit that resumes, and give it the batch size they found."""

    def __init__(self) -> None:
        self.batch_size_names: set[str] = set()  # those a run's BatchSizeFinder tunes, or its checkpoint kept

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        names = self.batch_size_names | {batch_size_name(finder) for finder in tuners(trainer, BatchSizeFinder)}
        if names:
            checkpoint[KEY] = {name: lightning_getattr(pl_module, name) for name in sorted(names)}

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        if trainer.state.fn != TrainerFn.FITTING or not checkpoint.get("global_step"):
            return  # a tuner loading back the state it saved before it tuned, or a checkpoint of nothing trained
        left_out = tuners(trainer, LearningRateFinder, BatchSizeFinder)
        # A new list: Lightning is going through the old one, calling this hook.
        trainer.callbacks = [callback for callback in trainer.callbacks if callback not in left_out]
        found = checkpoint.get(KEY, {})
        self.batch_size_names = set(found)
        for name, size in found.items():
            lightning_setattr(pl_module, name, size)
        if left_out:
            names = ", ".join(sorted({type(tuner).__name__ for tuner in left_out}))
            kept = [f"{name} {size} as found then" for name, size in found.items()]
            if any(isinstance(tuner, LearningRateFinder) for tuner in left_out):
                kept.insert(0, "the learning rate comes with the optimizer's state")
            if any(isinstance(tuner, BatchSizeFinder) for tuner in left_out) and not found:
                kept.append("the batch size is the configured one (the checkpoint kept none found)")
            rank_zero_info(f"resume: {names} tuned this run's first start and do not run again: {'; '.join(kept)}")


def tuners(trainer: Trainer, *kinds: type[Callback]) -> list[Callback]:
    return [callback for callback in trainer.callbacks if isinstance(callback, kinds)]


def batch_size_name(finder: BatchSizeFinder) -> str:
    """The attribute `finder` tunes: its `batch_arg_name`, kept by Lightning under a private name."""
    return getattr(finder, "_batch_arg_name", "batch_size")
