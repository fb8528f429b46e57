"""Step timing shared by the template's run (`step_timer.py`, `interleaved.py`) and the plain loop (`reference.py`).

Every side calls `StepClock.tick(epoch, images)` right after each optimizer step and writes the
same JSON, so the sides are timed over exactly the same window:

- steady-state throughput: images per second over the steps after `warmup`, counting only the
  intervals between two steps of the same epoch (an epoch boundary holds validation and
  checkpointing in the template and nothing in the reference: neither is training throughput);
- over the same intervals, diagnostics that other programs on the machine disturb less than the
  mean: the median step's throughput, the CPU time of this process (all its threads, so work
  done in background threads counts) and the page faults per step (memory the C library handed
  back to the system and takes again);
- the wall-clock time (`time.time()`) of the first optimizer step, from which the benchmark,
  which knows when it started the process, computes the start-up time.

When two sides take turns in one process, each side's clock is `restart`ed when its turn comes,
so that the other side's steps are not counted as an interval of this one.
"""

import itertools
import json
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch


def synchronize_on(device: torch.device) -> Callable[[], None] | None:
    """What waits for `device`'s queued work, for `StepClock`: none is needed on a CPU."""
    return torch.cuda.synchronize if device.type == "cuda" else None


class Tick(NamedTuple):
    wall: float  # time.perf_counter()
    cpu: float  # time.process_time()
    page_faults: int
    epoch: int
    images: int  # trained on in the step that just ended, over all processes
    after_step: bool  # False: a restart, the interval ending here was not this side's step


class StepClock:
    def __init__(self, warmup: int, steps: int, synchronize: Callable[[], None] | None = None) -> None:
        """`synchronize` waits for queued GPU work; it is called only where the clock stops or
        restarts (the window's ends, a turn's ends), so that the GPU can run ahead of the Python
        code in between, as it does in a normal run."""
        if warmup < 1 or steps < 1:
            raise ValueError(f"warmup and steps must be at least 1, got {warmup} and {steps}")
        self.warmup = warmup
        self.steps = steps
        self.synchronize = synchronize
        self.first_step_wall_time: float | None = None
        self.steps_taken = 0
        self.ticks: list[Tick] = []

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps

    @property
    def done(self) -> bool:
        return self.steps_taken >= self.total_steps

    def tick(self, epoch: int, images: int, last_of_turn: bool = False) -> None:
        """After an optimizer step of `epoch` that trained on `images` images (over all processes).

        `last_of_turn`: another side runs next in this process, so this step's GPU work must be
        finished before the clock reads the time."""
        if self.first_step_wall_time is None:
            self.first_step_wall_time = time.time()
        if self.done:
            return
        self.steps_taken += 1
        if last_of_turn or self.steps_taken in (self.warmup, self.total_steps):
            self._synchronize()
        self.ticks.append(self._read(epoch, images, after_step=True))

    def restart(self, epoch: int) -> None:
        """This side's turn begins: the next interval starts now, not at this side's last step."""
        self._synchronize()
        self.ticks.append(self._read(epoch, images=0, after_step=False))

    def result(self) -> dict:
        if not self.done:
            raise RuntimeError(f"only {self.steps_taken} of {self.total_steps} steps were timed")
        step_ticks = [number for number, tick in enumerate(self.ticks) if tick.after_step]
        window = self.ticks[step_ticks[self.warmup - 1] :]
        steps = [
            (start, end) for start, end in itertools.pairwise(window) if end.after_step and start.epoch == end.epoch
        ]
        if not steps:
            raise RuntimeError("every timed step crossed an epoch boundary: use more data or fewer steps")
        images = sum(end.images for _, end in steps)
        return {
            "images_per_s": images / sum(end.wall - start.wall for start, end in steps),
            "images_per_s_median_step": statistics.median(end.images / (end.wall - start.wall) for start, end in steps),
            "images_per_cpu_s": images / sum(end.cpu - start.cpu for start, end in steps),
            "page_faults_per_step": sum(end.page_faults - start.page_faults for start, end in steps) / len(steps),
            "steps_timed": len(steps),
            "first_step_wall_time": self.first_step_wall_time,
        }

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.result(), indent=2))

    def _synchronize(self) -> None:
        if self.synchronize is not None:
            self.synchronize()

    @staticmethod
    def _read(epoch: int, images: int, after_step: bool) -> Tick:
        page_faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        return Tick(time.perf_counter(), time.process_time(), page_faults, epoch, images, after_step)
