"""A callback that runs the plain PyTorch loop in turns with the template's own steps, in the template's processes.

The benchmark adds it to the template's real `fit` (`--trainer.callbacks+=...`). After the
template's warm-up steps the plain loop (`reference.PlainLoop`: its own `ConvNet`, optimizer and
data, wrapped in its own `DistributedDataParallel` over the process group Lightning set up) warms
up as many steps; then after every `turn` template steps (1: after each) it trains as many steps
of its own, until each side has `steps` timed steps. Each side's clock restarts when its turn
begins.

Run in separate processes, the two sides differ by up to a third on a virtual machine whose
processes each run faster or slower for their whole life. Taking turns in one process cancels
that, and short turns share out the bursts when the whole machine runs slower (about a second
long here) between the two sides: what is left is the cost of the template's code per step.
"""

import json
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from reference import PlainLoop
from timing import StepClock, synchronize_on


class InterleavedReference(Callback):
    def __init__(
        self,
        out: str,
        package: str,
        config: str,
        data_dir: str,
        warmup: int = 10,
        steps: int = 60,
        turn: int = 1,
        precision: str = "32-true",
        batch_size: int | None = None,
    ) -> None:
        if turn < 1:
            raise ValueError(f"turn must be at least 1, got {turn}")
        self.out = out
        self.plain_loop_args = (package, config, data_dir)
        self.warmup = warmup
        self.steps = steps
        self.turn = turn
        self.precision = precision
        self.batch_size = batch_size

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        synchronize = synchronize_on(pl_module.device)
        self.template = StepClock(self.warmup, self.steps, synchronize)
        self.reference = StepClock(self.warmup, self.steps, synchronize)
        self.plain: PlainLoop | None = None  # built at its first turn: the template's start-up is timed alone

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        clock = self.template
        if clock.done:
            return
        timed = clock.steps_taken + 1 - self.warmup  # this step's number in the timed window; 0 ends the warm-up
        turn_ends = timed >= 0 and (timed % self.turn == 0 or timed == self.steps)
        # Every process gets an equal share of each global batch (DistributedSampler pads the shards).
        clock.tick(trainer.current_epoch, len(batch[0]) * trainer.world_size, last_of_turn=turn_ends)
        if turn_ends:
            if self.plain is None:
                self.plain = PlainLoop(*self.plain_loop_args, pl_module.device, self.precision, self.batch_size)
            self._plain_turn()
            clock.restart(trainer.current_epoch)
        if clock.done and trainer.global_rank == 0:  # once: later calls return at the top
            self._write()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # The plain loop's DistributedDataParallel holds the process group. Released here, the group ends when
        # the run ends it, not at the interpreter's exit, where gloo's threads may abort the process (exit -6).
        if getattr(self, "plain", None) is not None:
            self.plain.model = None

    def _plain_turn(self) -> None:
        """The plain loop trains until it has taken as many steps as the template."""
        self.reference.restart(self.plain.epoch)
        with torch.enable_grad():
            while self.reference.steps_taken < self.template.steps_taken:
                images = self.plain.step()
                last = self.reference.steps_taken + 1 == self.template.steps_taken
                self.reference.tick(self.plain.epoch, images, last_of_turn=last)

    def _write(self) -> None:
        results = {"template": self.template.result(), "reference": self.reference.result()}
        Path(self.out).write_text(json.dumps(results, indent=2))
