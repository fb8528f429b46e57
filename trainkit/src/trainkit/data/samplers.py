"""The orders of an epoch that a training loader resumes in: each drawn from the seed and the epoch alone, each
process taking its share, so that a resumed run, on any number of processes, trains on the rest of the epoch.

ResumableSampler shuffles the dataset (or keeps its order); the others draw as the samplers of torch that they
stand for: a WeightedRandomSampler's draws, a SubsetRandomSampler's indices, a RandomSampler's draws of a set number
(or with replacement), a DistributedSampler's shares. data/resumable.py puts them in the loaders it rebuilds.
"""

import itertools
import math
from collections.abc import Iterator, Sequence, Sized

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.utils.data import DistributedSampler

from trainkit.data.worker_seeds import Drawn, seed_of


def say_resharded(before: int, now: int, left: int, again: int = 0, left_out: int = 0) -> None:
    """One line: the job goes on with the interrupted epoch on `now` processes instead of `before`."""
    again_too = f", and {again} trained before it again" if again else ""
    too_many = f"; {left_out} more left out, past the epoch's end here" if left_out else ""
    rank_zero_info(
        f"resharded: the interrupted epoch goes on over {now} process{'es' * (now > 1)} instead of {before}"
        f" ({left} samples left, each once{again_too}{too_many})"
    )


def share(rest: list[int], trained: list[int], rank: int, processes: int) -> list[int]:
    """Process `rank`'s share of the `rest` of an epoch (after the samples `trained` on before) on `processes`
    processes: every `processes`-th sample. As DistributedSampler does, the epoch's samples from its start (those
    trained on before first) are repeated where the rest does not share out evenly, so every process takes as many."""
    padding = itertools.islice(itertools.cycle(itertools.chain(trained, rest)), -len(rest) % processes)
    return (rest + list(padding))[rank::processes]


class ResumableSampler(DistributedSampler):
    """This process's share of the dataset, in an order set by the seed and the epoch alone.

    DistributedSampler makes each epoch's order of the whole dataset from its seed and the epoch
    Lightning sets before the epoch, and Lightning uses it as it is instead of adding its own. With
    R processes, process r takes the places r, r + R, r + 2R, ... of that order (with one process,
    all of them). So once every process has trained on k batches of B samples, the job has trained
    on the first k * B * R samples of the order, however many processes it ran on. A run that
    resumes the epoch shares out the rest of the order in the same way over the processes it has.
    """

    def __init__(
        self, dataset: Sized, num_replicas: int, rank: int, seed: int, shuffle: bool = True, size: int | None = None
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.size = len(dataset) if size is None else size  # the samples of an epoch's order
        self.num_samples = math.ceil(self.size / num_replicas)  # DistributedSampler's length: this process's share
        self.total_size = self.num_samples * num_replicas
        self.resumed = (0, 0)  # the epoch a checkpoint ended in and how many samples of its order were trained on
        self.passes = (0, 0)  # an epoch and how many passes of its order a cycled loader finished in it (combined)
        self.seeded_batch_size = 0  # >0: each batch's first index carries its seed for loader workers (seeded_batches)

    def trained_before(self) -> int:
        """How many samples of this epoch's order the job trained on before this run (0 in an epoch it began)."""
        epoch, samples = self.resumed
        return samples if epoch == self.epoch else 0

    def order(self) -> list[int]:
        """The epoch's order of the whole dataset: DistributedSampler's."""
        if not self.shuffle:
            return list(range(self.size))
        return torch.randperm(self.size, generator=self.epochs_generator()).tolist()

    def epochs_generator(self) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed + self.epoch)

    def passes_finished(self) -> int:
        """How many passes of this epoch's order a loader finished before this one (a shorter one Lightning cycles)."""
        epoch, passes = self.passes
        return passes if epoch == self.epoch else 0

    def __iter__(self) -> Iterator[int]:
        order = self.order()
        start = self.trained_before()
        mine = share(order[start:], order[:start], self.rank, self.num_replicas)
        if self.seeded_batch_size:  # a run resumes at the start of a batch, of each process's share as of the job's
            first = self.seed_of_first_place()
            for number in range(0, len(mine), self.seeded_batch_size):
                place = start + self.rank + number * self.num_replicas  # in the epoch's order
                mine[number] = Drawn(mine[number], first + place)
        return iter(mine)

    def seed_of_first_place(self) -> int:
        """A seed for the sample at the order's first place (the place p gets it + p), made from the run's seed, the
        epoch and the pass, so that every pass of every epoch draws anew."""
        return seed_of(self.seed, self.epoch, self.passes_finished())

    def say_resharded(self, before: int) -> None:
        """One line: the rest of the epoch goes on over this sampler's processes instead of `before`."""
        left, now = self.size - self.trained_before(), self.num_replicas
        say_resharded(before, now, left, again=-left % now)  # repeated to give every process as many

    def batches_left(self, batch_size: int, drop_last: bool, trained: int | None = None) -> int:
        """How many batches this process takes from the rest of the epoch (of its order after `trained` samples)."""
        trained = self.trained_before() if trained is None else trained
        samples = math.ceil((self.size - trained) / self.num_replicas)
        return samples // batch_size if drop_last else math.ceil(samples / batch_size)


class WeightedResumableSampler(ResumableSampler):
    """A WeightedRandomSampler's draws, made from the seed and the epoch alone and shared out as ResumableSampler's.

    The epoch's order is `draws` indices drawn by `weights` (torch.multinomial, as WeightedRandomSampler draws).
    """

    def __init__(
        self, dataset: Sized, weights: Tensor, draws: int, replacement: bool, num_replicas: int, rank: int, seed: int
    ) -> None:
        super().__init__(dataset, num_replicas, rank, seed=seed, size=draws)
        self.weights, self.replacement = weights, replacement

    def order(self) -> list[int]:
        return torch.multinomial(self.weights, self.size, self.replacement, generator=self.epochs_generator()).tolist()


class SubsetResumableSampler(ResumableSampler):
    """A SubsetRandomSampler's indices (a split of a dataset by indices), in an order set by the seed and the epoch
    alone and shared out as ResumableSampler's."""

    def __init__(self, dataset: Sized, indices: Sequence[int], num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(dataset, num_replicas, rank, seed=seed, size=len(indices))
        self.indices = list(indices)

    def order(self) -> list[int]:
        return [self.indices[place] for place in super().order()]


class RandomResumableSampler(ResumableSampler):
    """A RandomSampler's `num_samples` draws (an epoch of a set size, whatever the dataset's), with replacement or
    in whole shuffles of the dataset cut at that size, made from the seed and the epoch alone and shared out as
    ResumableSampler's."""

    def __init__(self, dataset: Sized, draws: int, replacement: bool, num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(dataset, num_replicas, rank, seed=seed, size=draws)
        self.replacement = replacement

    def order(self) -> list[int]:
        rows, generator = len(self.dataset), self.epochs_generator()
        if self.replacement:
            return torch.randint(rows, (self.size,), generator=generator).tolist()
        shuffles = [torch.randperm(rows, generator=generator) for _ in range(math.ceil(self.size / rows))]
        return torch.cat(shuffles)[: self.size].tolist()


class DistributedResumableSampler(ResumableSampler):
    """A DistributedSampler of the data module's own: the same order and shares, from its seed and the epoch.

    With `drop_last`, as there, the order leaves out the dataset's last places that would not share out evenly.
    """

    def __init__(self, drawn: DistributedSampler) -> None:
        dataset, replicas = drawn.dataset, drawn.num_replicas
        kept = len(dataset) - (len(dataset) % replicas if drawn.drop_last else 0)
        super().__init__(dataset, replicas, drawn.rank, seed=drawn.seed, shuffle=drawn.shuffle, size=kept)

    def order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.size))
        return torch.randperm(len(self.dataset), generator=self.epochs_generator())[: self.size].tolist()
