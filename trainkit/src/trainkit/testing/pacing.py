"""Test-only callbacks that slow a run down and say when it got somewhere, so a test can act at that moment."""

import os
import signal
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from trainkit.run import stopping


class PaceSteps(Callback):
    """Sleep after every training step; once step `at_step` is done, rank 0 creates the file `marker`.

    Each process also writes its process id to `<marker>.rank<global rank>`, for a test that signals one of them.
    A model that steps several optimizers per batch may step past `at_step`: the first batch at or after it counts.
    A run resumed past `at_step` creates no marker.
    """

    def __init__(self, marker: str, at_step: int = 3, seconds_per_step: float = 0.2) -> None:
        self.marker = Path(marker)
        self.at_step = at_step
        self.seconds_per_step = seconds_per_step
        self._before = 0  # the step before this batch

    def on_train_start(self, trainer: Trainer, *args: Any) -> None:
        self._before = trainer.global_step

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        time.sleep(self.seconds_per_step)
        reached = self._before < self.at_step <= trainer.global_step
        self._before = trainer.global_step
        if reached:
            Path(f"{self.marker}.rank{trainer.global_rank}").write_text(str(os.getpid()))
            if trainer.is_global_zero:
                self.marker.touch()


class PaceSanityCheck(Callback):
    """During the sanity check, rank 0 creates the file `marker`; every process sleeps after each batch."""

    def __init__(self, marker: str, seconds_per_batch: float = 2.0) -> None:
        self.marker = Path(marker)
        self.seconds_per_batch = seconds_per_batch

    def on_validation_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.sanity_checking:
            if trainer.is_global_zero:
                self.marker.touch()
            time.sleep(self.seconds_per_batch)


class PaceSetup(Callback):
    """In `setup`, every process but global rank 0 sleeps; rank 0 creates the file `marker` and goes on, to wait
    for them in the job's next collective (DistributedDataParallel's first broadcast)."""

    def __init__(self, marker: str, seconds: float = 60.0) -> None:
        self.marker = Path(marker)
        self.seconds = seconds

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if trainer.is_global_zero:
            self.marker.touch()
        else:
            time.sleep(self.seconds)


class PaceValidation(Callback):
    """In validation after training steps, rank 0 creates the file `marker`; every process sleeps after each batch."""

    def __init__(self, marker: str, seconds_per_batch: float = 1.0) -> None:
        self.marker = Path(marker)
        self.seconds_per_batch = seconds_per_batch

    def on_validation_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if not trainer.sanity_checking:
            if trainer.is_global_zero:
                self.marker.touch()
            time.sleep(self.seconds_per_batch)


class HangAtStep(Callback):
    """After step `at_step`, the main thread of global rank `rank` hangs while its other threads run on, as in a
    hung device call, a file read that never returns or a deadlock (`time.sleep` lets go of Python's lock)."""

    def __init__(self, rank: int, at_step: int = 5) -> None:
        self.rank = rank
        self.at_step = at_step

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.at_step:
            time.sleep(24 * 3600)


class SignalAtStep(Callback):
    """Once step `at_step` is done, every process sends itself SIGTERM and waits until the kit has noted it: a
    preemption that lands on that very step (an epoch's last, say), which a test's timing could not hit."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step != self.at_step:
            return
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 30
        while not stopping.stop_requested() and time.monotonic() < deadline:  # noted by a thread of its own
            time.sleep(0.01)
