"""Test-only callbacks that fail on purpose, for drills of how a job ends."""

from typing import Any

from lightning.pytorch import Callback, Trainer


class FailOnOneProcess(Callback):
    """Global rank `global_rank` raises a RuntimeError once step `at_step` is done, as a bug that only its share
    of the data meets would: the job must end with that process's status, not be retried as a lost node."""

    def __init__(self, global_rank: int, at_step: int = 5) -> None:
        self.global_rank = global_rank
        self.at_step = at_step

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_rank == self.global_rank and trainer.global_step >= self.at_step:
            raise RuntimeError(f"a row that only global rank {self.global_rank} reads (a drill)")
