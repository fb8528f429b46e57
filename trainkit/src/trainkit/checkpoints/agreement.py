"""Numbers that every process of a job agrees on, a few steps late, without ever waiting for a GPU.

The preemption and periodic checkpoints need every process to act at the same step: each process
proposes numbers (its stop signal's exit status, "my time is up") and all act on the highest. A flag
tensor on the training device would cost, each time, a copy to it and a `.item()` to read the answer:
on a GPU both wait until the GPU has run everything queued before them, so the CPU can no longer
queue the next steps' work ahead. Here the numbers never leave the CPU: they are all-reduced over
gloo (the job's own process group when that is gloo, as on CPUs; beside NCCL, a gloo group of the
same processes), started at one step and waited for at a later one, by when it has long finished.
Processes wait only for each other's CPUs, never for a GPU.
"""

from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from trainkit.run.lost_peers import wait_unless_lost

# The job's default group when a gloo group was last asked for, and the gloo group that goes with it
# (None: the default group is gloo itself). Made once per job: every agreement shares it.
_gloo_group: tuple[dist.ProcessGroup, dist.ProcessGroup | None] | None = None


def gloo_group(timeout: timedelta | None) -> dist.ProcessGroup | None:
    """A gloo group of every process of the job, for collectives on CPU tensors: None for the default group.

    Making a group is itself a collective: every process must ask at the same point (a hook such as
    `on_train_start`). `timeout` is how long a collective waits for the other processes (the strategy's,
    `cluster.timeout`).
    """
    global _gloo_group
    world = dist.group.WORLD
    if _gloo_group is None or _gloo_group[0] is not world:
        group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
        _gloo_group = (world, group)
    return _gloo_group[1]


class Agreement:
    """`size` non-negative integers each process proposes, and the highest proposal of each over all processes.

    `propose` starts the agreement without waiting for it; `agreed` waits for it (by then, usually, it
    has finished) and returns the same numbers on every process. Every process must call both at the
    same points of training, in turn: propose, agreed, propose, ...
    """

    def __init__(self, size: int = 1) -> None:
        self.size = size
        self._values, self._tensor = _shared_ints(size)
        self.shared = False  # with other processes; with none, the highest proposals are this process's
        self._group: dist.ProcessGroup | None = None
        self._work: dist.Work | None = None  # the all-reduce in flight
        self.pending = False  # proposed, and not read yet

    def start(self, timeout: timedelta | None) -> None:
        """Begin a fit: call on every process at the same point, before the first `propose`."""
        self._values, self._tensor = _shared_ints(self.size)  # anew: a copied callback would share nothing
        self.shared = dist.is_available() and dist.is_initialized()
        self._group = gloo_group(timeout) if self.shared else None
        self._work, self.pending = None, False  # an earlier fit's, which ended by an error

    def propose(self, *values: int) -> None:
        if len(values) != self.size:
            raise ValueError(f"{self.size} numbers to propose, got {len(values)}")
        for index, value in enumerate(values):
            self._values[index] = value  # in place: the tensor shares this memory
        if self.shared:
            self._work = dist.all_reduce(self._tensor, dist.ReduceOp.MAX, group=self._group, async_op=True)
        self.pending = True

    def agreed(self) -> tuple[int, ...]:
        """The highest of each number proposed at the last `propose`, by any process."""
        self.finish()
        self.pending = False
        return tuple(self._values.tolist())

    def finish(self) -> None:
        """Wait for the agreement in flight, if any: no collective left running when training ends.

        Raises LossReported when another process reported a lost peer meanwhile: a gloo all-reduce
        waiting on a stuck peer would otherwise wait for the whole timeout."""
        if self._work is not None:
            work, self._work = self._work, None
            wait_unless_lost(work)


def _shared_ints(size: int) -> tuple[np.ndarray, torch.Tensor]:
    """`size` int64 as a CPU tensor and a numpy array over the same memory: collectives write them through the
    tensor, `Agreement` reads and writes them through the array, with no tensor operation. The tensor owns the
    memory: a collective left running when the process exits (LossReported) frees it without Python."""
    tensor = torch.zeros(size, dtype=torch.int64)
    return tensor.numpy(), tensor
