"""A callback the benchmark adds to the template's real `fit` (`--trainer.callbacks+=...`).

It reads the clock after each optimizer step and changes nothing else; global rank 0 writes
the figures to `out` once the window is timed.
"""

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from timing import StepClock, synchronize_on


class StepTimer(Callback):
    def __init__(self, out: str, warmup: int = 10, steps: int = 40) -> None:
        self.out = out
        self.warmup = warmup
        self.steps = steps
        self.clock: StepClock | None = None
        self.written = False

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.clock = StepClock(self.warmup, self.steps, synchronize=synchronize_on(pl_module.device))

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Every process gets an equal share of each global batch (DistributedSampler pads the shards).
        self.clock.tick(trainer.current_epoch, images=len(batch[0]) * trainer.world_size)
        if self.clock.done and not self.written and trainer.global_rank == 0:
            self.clock.write(self.out)
            self.written = True
