"""A checkpoint on SIGTERM: every process stops at the same step, checkpoints/preempted.ckpt, exit 143.

A restarted job runs the same command again; `ckpt_path: last` in the config then resumes from
the newest of `last.ckpt` and `preempted.ckpt` in the checkpoint directory.
"""

import atexit
import logging
import os
import time
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.loggers.logger import DummyLogger
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info

from trainkit.checkpoints.agreement import Agreement
from trainkit.checkpoints.disk import checkpoint_dirs, newest_checkpoint
from trainkit.checkpoints.io import CheckpointNotWritten
from trainkit.checkpoints.saving import wait_for_checkpoints
from trainkit.checkpoints.steps import OptimizerSteps
from trainkit.checkpoints.stored import CheckpointNotStored, StoredCheckpointIO
from trainkit.run import stopping
from trainkit.run.wandb_service import leave_wandb

log = logging.getLogger(__package__)

PREEMPTED_WAIT_SECONDS = 60  # for the other processes of a node to stop after the checkpoint
# Several processes agree on a stop every AGREE_EVERY_SECONDS of training, counted in steps: each
# agreement costs the training process 0.1-1 ms (a gloo all-reduce handed to gloo's thread, slowest
# where every core is busy; bench/README.md in the template repository), as much as a small model's
# whole GPU step. With steps longer than that, every step.
AGREE_EVERY_SECONDS = 0.5
MOST_STEPS_BETWEEN_AGREEMENTS = 100  # bounds the delay when steps suddenly slow down


class PreemptionCheckpoint(Checkpoint):
    """On SIGTERM or SIGINT, every process stops at the same step, saves one checkpoint and exits 143 or 130.

    Kubernetes, cloud platforms and Slurm send SIGTERM before they stop a job; Ctrl-C sends SIGINT.
    Once training has started, a process that receives one only notes it (run/stopping.py; before
    training there is nothing to save and the process exits at once). The processes of a job
    combine what they noted every AGREE_EVERY_SECONDS of training, or after every step where a step
    takes longer (checkpoints/agreement.py: a max all-reduce on the CPU that runs while the next steps
    compute and is waited for at the next agreement, never waiting for a GPU), so they all stop at the
    same step and save one consistent checkpoint: at most two agreements after the signal, about
    1 s or two steps (the worst case against grace periods: bench/README.md in the template
    repository). A process alone stops after the step in which the signal came. At the end of an
    epoch they wait for the answer at once, so no validation starts after a signal. A signal during
    validation skips the rest of it: the weights have not changed since the last step, the processes
    agree when validation ends, and the resumed run goes on training without that validation's
    scores. The checkpoint is deleted once a later run has trained on from it to its end.

    A step is an optimizer step: with gradient accumulation the processes agree, and stop, only after a
    batch in which the optimizer stepped (checkpoints/steps.py), up to `accumulate_grad_batches` batches
    after the signal.
    """

    def __init__(self, dirpath: str | None = None, filename: str = "preempted") -> None:
        # Not Lightning's OnExceptionCheckpoint, which saves after any error: with one among the callbacks, Lightning
        # makes a fit with `ckpt_path: null` resume from the last checkpoint instead of starting afresh.
        super().__init__()
        self.dirpath = dirpath or "checkpoints"  # None: the command line puts it in the run's checkpoints/ directory
        self.filename = filename
        # The exit status a signal asked for on any process (0: go on), and the slowest process's mean step (µs).
        self._stop = Agreement(size=2)
        self._between = 1  # steps from one agreement to the next: the same on every process
        self._steps = 0  # since the last agreement
        self._since = time.monotonic()  # when the last agreement was proposed
        self._step_us = 0  # this process's mean step between the last two agreements
        self._optimizer_steps = OptimizerSteps()
        self._mid_accumulation = False  # the last batch added to gradients no step has applied yet
        self._trained = False  # whether this fit's training began (a fit whose checkpoint ended the run skips it)

    @property
    def ckpt_path(self) -> str:
        return os.path.join(self.dirpath, f"{self.filename}.ckpt")

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Every process, at the same point: the agreement may make the job's gloo group (a collective).
        self._stop.start(getattr(trainer.strategy, "_timeout", None))

    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning has just replaced the SIGTERM handler with its own, which broadcasts from rank 0
        # inside the handler: a collective the other processes never join.
        stopping.handle_stop_signals()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        def quiet_wandb() -> None:
            # Slurm signals every process of a task, wandb's service too, which then ends; a later
            # wandb call would fail the run before it stops and saves. It logs nothing more, and wandb
            # ends before its own exit hook (registered earlier, so run later) would reach the service.
            loggers = trainer.loggers
            if any(isinstance(logger, WandbLogger) for logger in loggers):
                trainer.loggers = [DummyLogger() if isinstance(logger, WandbLogger) else logger for logger in loggers]
                atexit.register(leave_wandb)

        stopping.save_before_stopping(on_signal=quiet_wandb)
        # Lightning also broadcasts its handler's flag from rank 0 before every training step and
        # waits for it. With its handler replaced that flag is never set, and the broadcast only
        # costs a synchronisation per step: 4-8% of the 2-process CPU throughput (bench/ in the
        # template repository). The kit's tests/test_speed.py checks that the method still exists.
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None
        self._between, self._steps, self._since, self._step_us = 1, 0, time.monotonic(), 0
        self._optimizer_steps.start(trainer)
        self._trained = True

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        last = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        self._mid_accumulation = not self._optimizer_steps.stepped(trainer) and not last
        if self._mid_accumulation:
            return  # a checkpoint now would lose this batch's gradients
        self._steps += 1
        if self._steps >= self._between or last:
            self._agree(trainer, at_once=last or not self._stop.shared)

    def on_validation_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if _validating_while_training(trainer) and stopping.stop_requested():
            raise StopIteration  # ends the validation loop: the rest of it is skipped

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Before the scores are computed. Processes may skip different parts of validation, so they
        # agree here, where each arrives once, and not after every validation batch. Validation that comes
        # in the middle of an accumulation leaves the stop to the step that ends it.
        if _validating_while_training(trainer) and not self._mid_accumulation:
            self._agree(trainer, at_once=True)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        stopping.stop_at_once()
        self._stop.finish()  # no collective left running

    def _agree(self, trainer: Trainer, at_once: bool) -> None:
        """Act on the agreement proposed last, and propose again; `at_once`: and act on this one too.

        Every process calls it at the same step: the steps between agreements come from agreed numbers only.
        """
        if self._stop.pending:
            self._stop_if_agreed(trainer)
        now = time.monotonic()
        if self._steps:  # none: validation since the last agreement, which is not a step
            self._step_us = round((now - self._since) / self._steps * 1e6)
        self._stop.propose(stopping.stop_requested(), self._step_us)
        self._steps, self._since = 0, now
        if at_once:
            self._stop_if_agreed(trainer)

    def _stop_if_agreed(self, trainer: Trainer) -> None:
        status, slowest_step_us = self._stop.agreed()  # the highest of all processes
        if status:
            self._save_and_exit(trainer, status)
        if self._stop.shared:
            self._between = steps_between_agreements(slowest_step_us)

    def _save_and_exit(self, trainer: Trainer, status: int) -> None:
        _finish_earlier_saves(trainer)  # so that a failure raised below is this checkpoint's own
        try:
            if trainer.fast_dev_run:  # it only tries the code: it never replaces a checkpoint the job resumes from
                saved = "a fast_dev_run saves nothing"
            else:
                try:
                    trainer.save_checkpoint(self.ckpt_path, weights_only=False)
                except CheckpointNotWritten:
                    # The processes that wrote raised before the barrier after the save (the first process; sharded,
                    # every one): the others are waiting in it.
                    trainer.strategy.barrier("Trainer.save_checkpoint")
                    raise
                wait_for_checkpoints(trainer)  # saved asynchronously: written before the process ends
                saved = f"saved {self.ckpt_path} at step {trainer.global_step}"
        except CheckpointNotWritten as error:
            older = newest_checkpoint(checkpoint_dirs(trainer))
            saved = (
                f"could not save {self.ckpt_path} at step {trainer.global_step} ({error.reason}); the job will resume"
                f" from {older or 'the start: there is no older checkpoint'}"
            )
        saved += _stored(trainer)
        rank_zero_info(f"{stopping.SIGNAL_NAME[status]}: {saved}; exiting ({status})")
        # The node's first process ends last, so the platform sees the node finished when it exits.
        # The processes Lightning started leave its watch list first: its watcher SIGKILLs the whole
        # node as soon as one of them exits non-zero, and here each exits 143 or 130.
        started = getattr(trainer.strategy.launcher, "procs", [])
        children = list(started)
        started.clear()
        for process in children:
            process.wait(timeout=PREEMPTED_WAIT_SECONDS)
        raise SystemExit(status)

    def on_exception(self, trainer: Trainer, *args: Any) -> None:
        # Only a coordinated stop saves: after a crash the other processes may never join a save.
        stopping.stop_at_once()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Lightning removes the file after every run that ends without an error: after `test`,
        # `validate` and `predict` too, which leaves the job nothing to resume from. Only a fit that
        # finished training (not a fast_dev_run, which only tries the code) has no more use for it. One
        # resumed from it that trained nothing (saved at the run's last step) keeps it: it is the run's end.
        if stage == "fit" and not trainer.fast_dev_run and self._trained:
            trainer.strategy.remove_checkpoint(self.ckpt_path)


def steps_between_agreements(step_us: int) -> int:
    """How many steps make AGREE_EVERY_SECONDS of training, at `step_us` microseconds a step (0: not known yet)."""
    if step_us <= 0:
        return 1
    return max(1, min(MOST_STEPS_BETWEEN_AGREEMENTS, int(AGREE_EVERY_SECONDS * 1e6) // step_us))


def _stored(trainer: Trainer) -> str:
    """Wait for the checkpoint store to have every checkpoint (the process is about to end), and say so."""
    io = trainer.strategy.checkpoint_io
    if not isinstance(io, StoredCheckpointIO) or not trainer.is_global_zero:
        return ""
    try:
        io.wait()
    except CheckpointNotStored as error:
        return f"; could not store it ({error.reason}); a new disk resumes from {io.latest or 'the start'}"
    return f", stored as {io.latest}"


def _finish_earlier_saves(trainer: Trainer) -> None:
    """Wait for the checkpoints still being written in the background; one that failed is only told: the preemption
    checkpoint saved next makes it needless."""
    try:
        wait_for_checkpoints(trainer)
    except CheckpointNotWritten as error:
        log.warning(f"{error}")


def _validating_while_training(trainer: Trainer) -> bool:
    return trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking
