"""How checkpoints are saved (the `checkpoint_saving:` section): in the background or not, and how long saves take.

Every save reports how long training waited for it and how long the write took. A write longer
than the time the platform gives between SIGTERM and SIGKILL warns: a preemption checkpoint would
be cut short there, and the job would resume from an older one.
"""

import logging
from dataclasses import dataclass
from pathlib import Path

from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_info
from pydantic import PositiveFloat

log = logging.getLogger(__package__)


@dataclass
class CheckpointSavingSettings:
    """The `checkpoint_saving:` section of the config.

    Args:
        asynchronous: write checkpoints in the background: training waits only for the copy of the
            weights out of the device (and, sharded, out of the process). The preemption checkpoint is
            always written before the process ends.
        grace_seconds: the time the platform gives between SIGTERM and SIGKILL (Kubernetes'
            terminationGracePeriodSeconds, 30 s by default; Slurm's KillWait). A save that takes
            longer is warned about.
    """

    asynchronous: bool = False
    grace_seconds: PositiveFloat = 30.0


class SaveTimes:
    """Reports each save in one line, and warns once when one takes longer than the grace period."""

    def __init__(self, grace_seconds: float = 30.0) -> None:
        self.grace_seconds = grace_seconds
        self._warned = False

    def report(self, path: str | Path, blocked_seconds: float, write_seconds: float) -> None:
        rank_zero_info(
            f"checkpoint {Path(path).name}: training waited {blocked_seconds:.2f} s, written in {write_seconds:.2f} s"
        )
        if write_seconds > self.grace_seconds and not self._warned:
            self._warned = True
            log.warning(
                f"saving {path} took {write_seconds:.1f} s, longer than the {self.grace_seconds:g} s the platform"
                " gives between SIGTERM and SIGKILL (checkpoint_saving.grace_seconds): a preemption checkpoint"
                " would be cut short and the job would resume from an older one. Give the job a longer grace"
                " period (terminationGracePeriodSeconds, Slurm's KillWait) or a faster disk."
            )


def wait_for_checkpoints(trainer: Trainer) -> None:
    """Return once every checkpoint this process saved is written: the checkpoint IO's files, and a sharded strategy's
    own saves. Raises the first failure (CheckpointNotWritten), after waiting for both."""
    failure: Exception | None = None
    for owner in (trainer.strategy.checkpoint_io, trainer.strategy):
        wait = getattr(owner, "wait_for_checkpoints", None)
        if wait is None:
            continue
        try:
            wait()  # every process calls it: a sharded strategy's may agree with the others on the commit
        except Exception as error:
            failure = failure or error
    if failure is not None:
        raise failure
