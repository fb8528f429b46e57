"""Random draws in loader workers (augmentation) that are the same in a run resumed mid-epoch as in one never stopped.

A worker's generators are otherwise seeded once, as it starts, so what a batch draws depends on which worker reads
it and what that worker read before. Here the training loader hands each batch's first index to its worker as a
`Drawn`, carrying a seed made from the batch's place in the epoch, and the worker seeds its generators from it
before it reads the batch (`seeded_batches`): each batch draws the same with any number of workers.
"""

import contextlib
import functools
import hashlib
import struct
from collections.abc import Callable
from typing import Any

from torch.utils.data import get_worker_info

from trainkit.data.generators import seed_cpu_generators


def seed_of(*numbers: int) -> int:
    """A seed made from `numbers` (the run's seed, an epoch, ...): another for any other numbers."""
    packed = struct.pack(f"<{len(numbers)}q", *numbers)
    return int.from_bytes(hashlib.blake2b(packed, digest_size=7).digest(), "little")


class Drawn(int):
    """A batch's first index, carrying the seed of its place in the epoch for the loader worker reading it."""

    seed: int

    def __new__(cls, index: int, seed: int) -> "Drawn":
        drawn = super().__new__(cls, index)
        drawn.seed = seed
        return drawn

    def __reduce__(self) -> tuple[type, tuple[int, int]]:  # sent to the workers with its seed
        return Drawn, (int(self), self.seed)


def seeded_batches(worker_init_fn: Callable[[int], None] | None, worker_id: int) -> None:
    """A loader worker's start: the loader's own `worker_init_fn`, then every batch read after seeding the worker's
    generators from the seed its first index carries."""
    if worker_init_fn is not None:
        worker_init_fn(worker_id)
    dataset = get_worker_info().dataset  # the worker's own copy: the dataset in training's process is left as it is
    read = functools.partial(read_seeded, dataset, getattr(type(dataset), "__getitems__", None))
    # Where the worker reads a batch: torch's fetcher calls `dataset.__getitems__` where there is one. A list or an
    # array takes no attribute, and draws nothing when read.
    with contextlib.suppress(AttributeError):
        dataset.__getitems__ = read


def read_seeded(dataset: Any, read_batch: Callable[[Any, list[int]], list] | None, indices: list[int]) -> list:
    """The samples at `indices`, read by the dataset's own `__getitems__` (`read_batch`) or one by one, after
    seeding the generators from the first index's seed."""
    seed = getattr(indices[0], "seed", None)
    if seed is not None:
        seed_cpu_generators(seed)
        indices = [int(indices[0]), *indices[1:]]  # the dataset is handed plain indices
    return read_batch(dataset, indices) if read_batch else [dataset[index] for index in indices]
