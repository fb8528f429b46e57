"""Training data that resumes exactly where a preempted run stopped, in the middle of an epoch too.

Lightning keeps the state of a training loader that has `state_dict`/`load_state_dict` in its
checkpoints and hands it back when it resumes from one that ended mid-epoch. The state here is
where training stands: the epoch and how many of its batches were trained on, as the Trainer
counts them (a loader may have handed out more: Lightning fetches ahead when it cannot tell
from the loader's length which batch is the last).
"""

from collections.abc import Iterator, Sized
from typing import Any

import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader, DistributedSampler


def batches_trained(trainer: Trainer) -> int | None:
    """How many batches of the current epoch training has finished; None once it has finished them all."""
    trained = trainer.fit_loop.epoch_loop.batch_progress.current.processed
    return None if trained >= trainer.num_training_batches else trained


class ResumableSampler(DistributedSampler):
    """This process's share of the dataset, in an order set by the seed and the epoch alone.

    DistributedSampler makes each epoch's order from its seed and the epoch Lightning sets
    before the epoch, and Lightning uses it as it is instead of adding its own. With one
    process it is the whole dataset, in the same kind of order. `start` skips the first samples
    of the next pass: the ones an interrupted run had already trained on.
    """

    def __init__(self, dataset: Sized, num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.start = 0

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        start, self.start = self.start, 0
        return iter(indices[start:])


class ResumableDataLoader(DataLoader):
    """A training DataLoader over a map-style dataset that Lightning resumes mid-epoch.

    Its random draws (the seeds of its worker processes) come from a generator seeded by the
    epoch, not from torch's global generator, which checkpoints restore for the model's use.
    """

    def __init__(self, *args: Any, trainer: Trainer | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trainer = trainer
        if self.generator is None:
            self.generator = torch.Generator()

    def __iter__(self) -> Iterator[Any]:
        # A generator, so nothing is drawn before the first batch is asked for: Lightning creates
        # the iterator before it sets the epoch, and workers would start on the order at once.
        self.generator.manual_seed(getattr(self.sampler, "seed", 0) + getattr(self.sampler, "epoch", 0))
        yield from super().__iter__()

    def state_dict(self) -> dict[str, int]:
        epoch, trained = getattr(self.sampler, "epoch", 0), batches_trained(self.trainer)
        # After an epoch's last batch, the next run starts the next epoch.
        return {"epoch": epoch + 1, "batches": 0} if trained is None else {"epoch": epoch, "batches": trained}

    def load_state_dict(self, state: dict[str, int]) -> None:
        # `trainer.overfit_batches` swaps in a plain sequential sampler: nothing to resume then.
        if isinstance(self.sampler, ResumableSampler):
            self.sampler.set_epoch(state["epoch"])
            self.sampler.start = state["batches"] * self.batch_size
