"""Test-only callbacks for the sharded strategy's drills."""

import os
import signal

from lightning.pytorch import Callback, LightningModule, Trainer

from trainkit.strategies import sharded


class KillBeforeCommit(Callback):
    """SIGKILL this process during the save of step `at_step`: after every shard is written, before the commit."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        commit = sharded.commit

        def commit_unless_killed(directory, step: int, world_size: int) -> None:
            if step == self.at_step:
                os.kill(os.getpid(), signal.SIGKILL)
            commit(directory, step, world_size)

        sharded.commit = commit_unless_killed
