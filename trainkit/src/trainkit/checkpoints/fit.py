"""A checkpoint that does not fit the run, refused in one line that says what to do (and one that has ended, said).

A run that EarlyStopping had stopped trains nothing more when resumed: Lightning would train another epoch on each
rerun of the same command, until the next validation stopped it again.

It happens when a run directory is reused: `ckpt_path: last` finds the old run's checkpoint. If the
model changed shape since (another `model.hidden`, an edited network), torch would end the run with
a traceback listing every mismatched tensor; if the old run trained past this run's `max_epochs`,
Lightning would end it with a traceback once everything is set up.
"""

from functools import partial
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import EarlyStopping
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from trainkit.checkpoints.epoch_end import saved_at_an_epochs_last_step
from trainkit.run.errors import ConfigError


class RefuseCheckpointsThatDoNotFit(Callback):
    """Compare a checkpoint's tensors with the model's, by name and shape, and its epoch with max_epochs."""

    def __init__(self) -> None:
        self.hook: RemovableHandle | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Lightning restores checkpoints after `setup` and before training, through the module's load_state_dict.
        self.hook = pl_module.register_load_state_dict_pre_hook(partial(refuse_if_it_does_not_fit, trainer))

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.hook is not None:
            self.hook.remove()

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        if trainer.state.fn != TrainerFn.FITTING:
            return
        # Lightning refuses a fit resumed past max_epochs (the epochs finished, once ResumeFinishedEpochs has ended
        # an epoch whose last step the checkpoint holds) only after the set-up, with a traceback.
        epochs_done, max_epochs = epochs_and_step(checkpoint)[0], trainer.max_epochs
        if max_epochs not in (None, -1) and epochs_done > max_epochs:
            raise ConfigError(
                f"checkpoint {trainer.ckpt_path} had finished {epochs_done} epochs, past trainer.max_epochs"
                f" {max_epochs}: raise trainer.max_epochs to train on from it, or start afresh in a new run"
                " directory (--trainer.default_root_dir)"
            )
        # A run that had ended: Lightning says only that max_epochs is reached, and training ends with exit 0.
        ended = ended_at(checkpoint, max_epochs, trainer.max_steps)
        if ended is not None:
            where, limit = ended
            if saved_at_an_epochs_last_step(checkpoint):  # a SIGTERM at the run's last step
                rank_zero_info(
                    f"resume: {trainer.ckpt_path} was saved at the run's last step ({where}), before its last"
                    " epoch's end: nothing is left to train. It stays, the run's newest checkpoint (`--ckpt_path"
                    " last` finds it); its last validation did not run (`validate --ckpt_path last` runs it)"
                )
                return
            rank_zero_info(
                f"resume: {trainer.ckpt_path} ended its run already, at {where}: nothing is left to train. Raise"
                f" {limit} to train on, or start a new run in another directory (--trainer.default_root_dir)"
            )
            return
        stopper = stopped_early(trainer, checkpoint)
        if stopper is not None:
            trainer.should_stop = True  # before the first epoch: Lightning resets it only when fit is called
            # Its state does not say why: the metric stopped improving, or was not finite (a run that diverged).
            rank_zero_info(
                f"resume: {trainer.ckpt_path} ended its run already: EarlyStopping on {stopper.monitor} stopped it;"
                " nothing is left to train. Leave EarlyStopping out to train on, or start a new run in another"
                " directory (--trainer.default_root_dir)"
            )
            return
        # Lightning says only which file it restores; where in the run that file is tells the researcher what is left.
        epochs_done, step = epochs_and_step(checkpoint)
        # A stop at an epoch's last step resumes as that epoch's end (checkpoints/epoch_end.py), without its validation.
        skipped = f"; epoch {epochs_done}'s validation did not run" if saved_at_an_epochs_last_step(checkpoint) else ""
        rank_zero_info(
            f"resume: going on from {trainer.ckpt_path}, saved at step {step} with {epochs_done} epoch"
            f"{'' if epochs_done == 1 else 's'} finished{skipped}"
        )


def ended_at(checkpoint: dict[str, Any], max_epochs: int | None, max_steps: int) -> tuple[str, str] | None:
    """Where a checkpoint's run reached this run's max_epochs or max_steps, and which of the two it reached."""
    epochs_done, step = epochs_and_step(checkpoint)
    if max_epochs not in (None, -1) and epochs_done >= max_epochs:
        return f"epoch {epochs_done} of trainer.max_epochs {max_epochs}", "trainer.max_epochs"
    if max_steps != -1 and step >= max_steps:
        return f"step {step} of trainer.max_steps {max_steps}", "trainer.max_steps"
    return None


def epochs_and_step(checkpoint: dict[str, Any]) -> tuple[int, int]:
    """How many epochs a checkpoint's run had finished (one saved at an epoch's last step, that epoch too: it resumes
    as the epoch's end), and its step."""
    epochs = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_progress", {}).get("current", {})
    return epochs.get("processed", 0) + saved_at_an_epochs_last_step(checkpoint), checkpoint.get("global_step", 0)


def stopped_early(trainer: Trainer, checkpoint: dict[str, Any]) -> EarlyStopping | None:
    """The run's EarlyStopping whose state in `checkpoint` had stopped training, if any."""
    epochs_done, step = epochs_and_step(checkpoint)
    if epochs_done < (trainer.min_epochs or 0) or step < (trainer.min_steps or 0):
        return None  # Lightning trains on to min_epochs and min_steps, whatever EarlyStopping says
    states = checkpoint.get("callbacks", {})
    for callback in trainer.callbacks:
        if isinstance(callback, EarlyStopping) and callback.state_key in states:
            state = states[callback.state_key]
            if state.get("stopped_epoch", 0) > 0 or state.get("wait_count", 0) >= state.get("patience", 1):
                return callback
    return None


def refuse_if_it_does_not_fit(
    trainer: Trainer, module: nn.Module, state_dict: dict[str, Any], prefix: str, metadata: Any, strict: bool, *_
) -> None:
    refuse_mismatches(trainer.ckpt_path, mismatches(module.state_dict(), state_dict, strict))


def refuse_mismatches(ckpt_path: Any, problems: list[str]) -> None:
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ConfigError(
            f"checkpoint {ckpt_path} does not fit the model: {problems[0]}{more}; it was written by a model of"
            " another shape: start afresh in a new run directory (--trainer.default_root_dir) or point ckpt_path at"
            " a checkpoint of this model"
        )


def mismatches(model: dict[str, Any], checkpoint: dict[str, Any], strict: bool) -> list[str]:
    """What differs between the model's tensors and a checkpoint's, as torch's strict loading would find it."""
    problems = [
        f"{name} is {_shape(checkpoint[name])} in the checkpoint, {_shape(tensor)} in the model"
        for name, tensor in model.items()
        if name in checkpoint and _shape(checkpoint[name]) != _shape(tensor)
    ]
    if strict:
        problems += [f"the checkpoint has no {name}" for name in model if name not in checkpoint]
        problems += [f"the model has no {name}" for name in checkpoint if name not in model]
    return problems


def _shape(value: Any) -> str:
    if isinstance(value, Tensor):
        return "x".join(map(str, value.shape)) or "a scalar"
    return type(value).__name__
