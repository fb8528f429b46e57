"""A training loader's batch sampler of the data module's own (batches of samples of about the same length, say),
read so that a run stopped mid-epoch goes on with the batch after the last one it trained on.

Lightning shares the batch sampler's `sampler` out over the processes and sets its epoch, as it does without the
kit. Each epoch's batches are then drawn in full as the epoch starts, with Python's, NumPy's and torch's CPU
generators seeded by the run's seed and the epoch (and put back as they were after, so the model's own draws do
not move): the same batches in a run resumed mid-epoch as in one never stopped, which leaves out the batches its
checkpoint trained on. A process's batches follow from its share, so they resume on as many processes as before.
"""

from collections.abc import Iterator, Sized
from typing import Any

import numpy as np

from trainkit.data.generators import cpu_generators_seeded
from trainkit.data.worker_seeds import Drawn, seed_of


class OwnBatches:
    """The batches a ResumableDataLoader with a batch sampler of its own reads, from the batch after those trained."""

    def __init__(self, batch_sampler: Any, seed: int, rank: int, processes: int) -> None:
        self.batch_sampler = batch_sampler
        self.seed, self.rank, self.processes = seed, rank, processes
        self.epoch = 0
        self.resumed = (0, 0)  # the epoch a checkpoint ended in and how many of its batches each process trained on
        self.seeded = False  # each batch's first index carries a seed for loader workers (worker_seeds.py)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        set_own_epoch = getattr(self.batch_sampler, "set_epoch", None)
        if callable(set_own_epoch):  # Lightning sets only the epoch of the batch sampler's `sampler`
            set_own_epoch(epoch)

    def __len__(self) -> int:
        assert isinstance(self.batch_sampler, Sized)  # not_resumable_because leaves out one with no length
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[Any]:
        with cpu_generators_seeded(seed_of(self.seed, self.epoch)):  # the same on every process, as seed_everything's
            batches = list(self.batch_sampler)
        epoch, trained = self.resumed
        for number in range(trained if epoch == self.epoch else 0, len(batches)):
            batch = batches[number]
            if self.seeded and isinstance(batch[0], int | np.integer):
                batch = [Drawn(int(batch[0]), seed_of(self.seed, self.epoch, number, self.rank)), *batch[1:]]
            yield batch
