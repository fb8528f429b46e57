"""A checkpoint saved between an epoch's last batch and the next epoch's start resumes as that epoch's end.

Lightning 2.6 reads the state of its loops in a checkpoint to tell where in an epoch it was saved, and
gets two such points wrong, in ways that depend on the run's limit:

- after the last batch's step (the periodic and preemption checkpoints, a ModelCheckpoint every N
  steps), resumed with `max_epochs`: the next epoch runs without being counted as started. A
  checkpoint saved in it reads as one saved after it, and the next run starts that epoch again at
  its first batch: the epoch's batches before the interruption are trained twice (3 epochs of 18 batches
  became 55 steps). Resumed with `max_steps`, the counts go wrong the same way one resume later.
  (Lightning's issue 19815 reports the batch-end half of this.)
- at the epoch's end (ModelCheckpoint's last.ckpt), resumed with `max_steps`: the epoch ends a second
  time and the next one is trained in another epoch's order.

The loop state of such a checkpoint is rewritten, when it is loaded, to that of the epoch once ended:
the resumed run starts the next epoch, in that epoch's order, as an uninterrupted run does. What the
epoch still had to do is skipped: its validation, when the checkpoint was saved before it (the
weights are those it would have scored; what validation draws at random never moves training's
generators: checkpoints/rng_state.py), and its end hooks. A checkpoint saved after the epoch's
validation and before its end (ModelCheckpoint with `val_check_interval` below 1, the preemption
checkpoint during validation) Lightning resumes right: it is left as it is. The kit's
tests/test_epoch_end_resume.py kills runs around epochs' ends, by epochs and by steps, with and
without validation, and compares what they train with an uninterrupted run.
"""

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer


class ResumeFinishedEpochs(Callback):
    """Rewrite a checkpoint that Lightning would resume wrongly, from just after an epoch's last batch, as that
    epoch's end."""

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        fit = checkpoint.get("loops", {}).get("fit_loop")
        try:
            misread = fit is not None and misread_after_an_epochs_last_batch(fit)
        except (KeyError, TypeError):
            return  # loops saved in another layout (another Lightning release): Lightning reads them as they are
        if misread:
            end_the_epoch(fit)


def misread_after_an_epochs_last_batch(fit: dict[str, Any]) -> bool:
    """Whether the fit loop's state `fit` was saved after an epoch's last batch, before the epoch ended, at a
    point Lightning misreads: before the batch counted as complete, or in the epoch's end hooks."""
    epochs, batches = fit["epoch_progress"]["total"], fit["epoch_loop.batch_progress"]
    epoch_unfinished = epochs["started"] == epochs["ready"] and epochs["completed"] < epochs["ready"]
    last_batch_trained = batches["is_last_batch"] and batches["total"]["processed"] == batches["total"]["ready"]
    before_the_batch_completed = batches["total"]["completed"] < batches["total"]["processed"]
    in_the_epochs_end = epochs["processed"] == epochs["started"]
    return epoch_unfinished and last_batch_trained and (before_the_batch_completed or in_the_epochs_end)


def saved_at_an_epochs_last_step(checkpoint: dict[str, Any]) -> bool:
    """Whether a checkpoint was saved right after an epoch's last step: before the epoch's validation and its end (a
    preemption or periodic checkpoint of that step). It resumes as the epoch's end."""
    try:
        fit = checkpoint["loops"]["fit_loop"]
        batches = fit["epoch_loop.batch_progress"]["total"]
        return misread_after_an_epochs_last_batch(fit) and batches["completed"] < batches["processed"]
    except (KeyError, TypeError):
        return False  # loops saved in another layout: Lightning reads them as they are


def end_the_epoch(fit: dict[str, Any]) -> None:
    """Make the fit loop's state `fit` that of its epoch once ended: as Lightning leaves it before the next one."""
    epochs, batches = fit["epoch_progress"], fit["epoch_loop.batch_progress"]
    if epochs["total"]["processed"] < epochs["total"]["started"]:
        # Saved before the loop counted the last batch as one that stepped (it does so after validation).
        fit["epoch_loop.state_dict"]["_batches_that_stepped"] += 1
    for counts in (epochs["total"], epochs["current"]):
        counts["processed"] = counts["completed"] = counts["started"]
    batches["total"] = dict.fromkeys(batches["total"], batches["total"]["processed"])
    batches["current"] = dict.fromkeys(batches["current"], 0)
    batches["is_last_batch"] = False
    # The epoch is over: no training loader resumes inside it (Lightning restores them only mid-epoch).
    fit.get("state_dict", {}).pop("combined_loader", None)
