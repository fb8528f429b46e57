"""A training loader's batch sampler of the data module's own (batches of samples of about the same length, say),
read so that a run stopped mid-epoch goes on with the batch after the last one it trained on.

Lightning shares the batch sampler's `sampler` out over the processes and sets its epoch, as it does without the
kit (on one process the kit gives it the one share, so that every number of processes draws alike). Each epoch's
batches are then drawn in full as the epoch starts, with Python's, NumPy's and torch's CPU generators seeded by the
run's seed and the epoch (and put back as they were after, so the model's own draws do not move): the same batches
in a run resumed mid-epoch as in one never stopped, which leaves out the batches its checkpoint trained on.

A run resumed on another number of processes draws the batches each old process had again, takes the samples of
those it had not trained on yet, shares them out over the processes it has now and has the batch sampler batch
each new share: the rest of the epoch, each sample once, in batches the researcher's own code made.
"""

from collections.abc import Callable, Iterator, Sized
from typing import Any

import numpy as np
from torch.utils.data import DistributedSampler, Sampler

from trainkit.data.generators import cpu_generators_seeded
from trainkit.data.samplers import say_resharded, share
from trainkit.data.worker_seeds import Drawn, seed_of

# The arrangements of an epoch's batches that a job went on from, oldest first: on how many processes, and how many
# batches each process had trained on when the job stopped. Empty in an epoch that never changed its processes.
Earlier = tuple[tuple[int, int], ...]


class Listed(Sampler[int]):
    """A share of the rest of an epoch, for the batch sampler to batch: these indices, in this order."""

    def __init__(self, indices: list[int]) -> None:
        self.indices = indices

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class OwnBatches:
    """The batches a ResumableDataLoader with a batch sampler of its own reads, from the batch after those trained.

    `remake` makes the data module's batch sampler again over another sampler (None where it cannot be remade).
    """

    def __init__(
        self, batch_sampler: Any, seed: int, rank: int, processes: int, remake: Callable[[Sampler], Any] | None = None
    ) -> None:
        self.batch_sampler, self.remake = batch_sampler, remake
        self.seed, self.rank, self.processes = seed, rank, processes
        self.epoch = 0
        self.resumed = (0, 0)  # the epoch a checkpoint ended in and how many of its batches each process trained on
        self.went_on: tuple[int, Earlier] = (0, ())  # the epoch a checkpoint ended in and its earlier arrangements
        self.seeded = False  # each batch's first index carries a seed for loader workers (worker_seeds.py)
        self._drawn: tuple[tuple[int, Earlier], list] | None = None  # this process's batches of an epoch, once drawn

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch  # the batch sampler's own epoch is set as its batches are drawn (`drawn`)

    def __len__(self) -> int:
        assert isinstance(self.batch_sampler, Sized)  # not_resumable_because leaves out one with no length
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[Any]:
        epoch, trained = self.resumed
        level = len(self.earlier())
        batches = self.batches()
        for number in range(trained if epoch == self.epoch else 0, len(batches)):
            batch = batches[number]
            if self.seeded and isinstance(batch[0], int | np.integer):
                seed = seed_of(self.seed, self.epoch, number, self.rank, *arrangement(level))
                batch = [Drawn(int(batch[0]), seed), *batch[1:]]
            yield batch

    def earlier(self) -> Earlier:
        """The arrangements of this epoch's batches that the job went on from (empty where it never resharded)."""
        epoch, earlier = self.went_on
        return earlier if epoch == self.epoch else ()

    def reshardable(self) -> bool:
        """Whether the batches of any number of processes can be drawn here: the batch sampler can be remade over
        another sampler, and batches the share of a DistributedSampler (Lightning's, or the kit's on one process)."""
        return self.remake is not None and type(getattr(self.batch_sampler, "sampler", None)) is DistributedSampler

    def first_batch(self) -> int:
        """Where the Trainer's count of the epoch's batches stands when this process's batches begin: after as many
        as it would have had before, in an epoch that went on with fewer."""
        return max(0, len(self) - len(self.batches())) if self.earlier() else 0

    def batches(self) -> list:
        """This process's batches of the epoch: the batch sampler's, or the rest of the earlier arrangements'."""
        earlier = self.earlier()
        if not earlier:
            return self.drawn(self.batch_sampler)
        if self._drawn is None or self._drawn[0] != (self.epoch, earlier):  # drawn once: it draws every old process's
            rest, trained = self.rest(earlier)
            shared = Listed(share(rest, trained, self.rank, self.processes))
            self._drawn = ((self.epoch, earlier), self.drawn(self.remake(shared), len(earlier)))
        return self._drawn[1]

    def rest(self, earlier: Earlier) -> tuple[list[int], list[int]]:
        """The samples of the epoch that the arrangements in `earlier` left untrained, and those they trained on."""
        rest: list[int] | None = None
        trained: list[int] = []
        for level, (processes, batches_trained) in enumerate(earlier):
            drawn = [self.drawn(self.remake(self.share_sampler(rest, trained, rank, processes)), level)
                     for rank in range(processes)]  # fmt: skip
            trained += [index for batches in drawn for batch in batches[:batches_trained] for index in batch]
            rest = [index for batches in drawn for batch in batches[batches_trained:] for index in batch]
        assert rest is not None
        return rest, trained

    def share_sampler(self, rest: list[int] | None, trained: list[int], rank: int, processes: int) -> Sampler:
        """The sampler of process `rank`'s share on `processes` processes: of the epoch, or of `rest`."""
        if rest is not None:
            return Listed(share(rest, trained, rank, processes))
        own = self.batch_sampler.sampler
        whole = DistributedSampler(own.dataset, processes, rank, shuffle=own.shuffle, seed=own.seed,
                                   drop_last=own.drop_last)  # fmt: skip
        whole.set_epoch(self.epoch)
        return whole

    def drawn(self, batch_sampler: Any, level: int = 0) -> list:
        """All the batches of `batch_sampler` in this epoch, drawn the same on every process and in every run."""
        set_own_epoch(batch_sampler, self.epoch)  # Lightning sets only the epoch of the batch sampler's `sampler`
        with cpu_generators_seeded(seed_of(self.seed, self.epoch, *arrangement(level))):
            return list(batch_sampler)

    def say_resharded(self, before: int) -> None:
        """One line: the rest of the epoch goes on over this job's processes instead of `before` (said by process 0,
        which counts the samples that the batch sampler leaves out of every new share's batches: `drop_last`)."""
        if self.rank != 0:
            return
        earlier, now = self.earlier(), self.processes
        rest, trained = self.rest(earlier)
        shares = [share(rest, trained, rank, now) for rank in range(now)]
        batched = [self.drawn(self.remake(Listed(indices)), len(earlier)) for indices in shares]
        left_out = sum(len(indices) - sum(map(len, batches)) for indices, batches in zip(shares, batched, strict=True))
        say_resharded(before, now, len(rest), again=-len(rest) % now, left_out=left_out)


def arrangement(level: int) -> tuple[int, ...]:
    """What a seed adds for the arrangement at `level` of an epoch's: nothing for the epoch's own (0), the seeds of
    a run that never resharded."""
    return (level,) if level else ()


def set_own_epoch(batch_sampler: Any, epoch: int) -> None:
    """Set the epoch of a batch sampler that has `set_epoch` of its own."""
    set_epoch = getattr(batch_sampler, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)
