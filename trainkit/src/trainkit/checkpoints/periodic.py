"""A checkpoint every few minutes inside an epoch: a hard kill loses minutes of training, not an epoch.

SIGTERM and Ctrl-C leave a checkpoint of the very step (checkpoints/preemption.py), but nothing can save after
SIGKILL: the out-of-memory killer, a node that dies, a grace period too short. The job then resumes
from its newest checkpoint, which without this one is the last epoch's end: hours, on a large dataset.
"""

import time
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint

from trainkit.checkpoints.agreement import Agreement
from trainkit.checkpoints.steps import OptimizerSteps
from trainkit.run.errors import ConfigError

# The processes compare clocks after every 10th batch, so a save comes at most 20 batches late. After
# every batch it cost 0.7% of the 2-process CPU throughput (bench/ in the template repository, about
# its noise); after every 10th, 0.4%, within the noise.
CLOCK_BATCHES = 10


class PeriodicCheckpoint(Checkpoint):
    """Save `<dirpath>/<filename>.ckpt` every `every_minutes` of training, or every `every_n_steps` steps if set.

    One file, replaced atomically each time (checkpoints/io.py), which `ckpt_path: last` resumes from
    when it is the newest checkpoint. Every process must save at the same step. Steps count alike
    everywhere; clocks do not, so the processes combine theirs (a max all-reduce of "time is up" on
    the CPU, checkpoints/agreement.py, that runs while the next CLOCK_BATCHES batches compute and is
    waited for after them): no process waits for another, or for a GPU, at any step but the one that
    saves. With gradient accumulation a save that falls due waits for the batch that steps the optimizer
    (checkpoints/steps.py).
    """

    def __init__(
        self,
        every_minutes: float = 10.0,
        every_n_steps: int | None = None,
        dirpath: str | None = None,
        filename: str = "periodic",
    ) -> None:
        if every_minutes <= 0 or (every_n_steps is not None and every_n_steps < 1):
            raise ConfigError("PeriodicCheckpoint: every_minutes must be above 0, every_n_steps 1 or more")
        self.seconds = every_minutes * 60
        self.every_n_steps = every_n_steps
        # dirpath None: the command line puts it in the run's checkpoints/ directory.
        self.dirpath = dirpath or "checkpoints"
        self.path = Path(self.dirpath, f"{filename}.ckpt")
        self._saved_at = time.monotonic()
        self._batches = 0  # trained since training started, counted alike by every process
        self._time_is_up = Agreement()  # 1 once any process found its time up
        self._due = False  # the processes agreed that the time is up, and have not saved since
        self._optimizer_steps = OptimizerSteps()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._saved_at = time.monotonic()
        self._batches = 0
        self._due = False
        self._optimizer_steps.start(trainer)
        self._time_is_up.start(getattr(trainer.strategy, "_timeout", None))  # every process, at the same point

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.fast_dev_run:
            return  # it only tries the code: it never replaces a checkpoint the job resumes from
        self._batches += 1
        stepped = self._optimizer_steps.stepped(trainer)
        if self.every_n_steps is not None:
            self._due = trainer.global_step % self.every_n_steps == 0
        elif self._batches % CLOCK_BATCHES == 0 and self._agreed_time_is_up():
            self._due = True
        if self._due and stepped:
            trainer.save_checkpoint(self.path, weights_only=False)  # said: Lightning logs its default otherwise
            self._saved_at, self._due = time.monotonic(), False

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._time_is_up.finish()  # no collective left running when the job ends

    def _agreed_time_is_up(self) -> bool:
        """Whether any process found its time up when last asked; asks again."""
        time_is_up = time.monotonic() - self._saved_at >= self.seconds
        if not self._time_is_up.shared:
            return time_is_up  # one process: no one to agree with
        agreed = self._time_is_up.pending and self._time_is_up.agreed() == (1,)
        # Asked after a save too: that one is answered "no", so no two saves follow each other.
        self._time_is_up.propose(int(time_is_up and not agreed))
        return agreed
