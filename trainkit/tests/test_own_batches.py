"""A training loader batched by a batch sampler of the researcher's own (batches of samples of about one length, as
language models batch sentences) resumes mid-epoch exactly; a BatchSampler spelled out resumes as `batch_size`."""

import random
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, Sampler

from trainkit.data.resumable import ResumableDataLoader
from trainkit.data.samplers import ResumableSampler

from .test_resumable import Jittered, TrainLoaders, fit, random_images


class ByLength(BatchSampler):
    """Batches of samples of about one length: pools of 4 batches of the sampler's order, each sorted by length,
    the batches shuffled by Python's generator and torch's."""

    def __init__(self, sampler: Sampler[int], batch_size: int, drop_last: bool, lengths: list[int]) -> None:
        super().__init__(sampler, batch_size, drop_last)
        self.lengths = lengths
        self.epochs_set: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs_set.append(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        order, pool = list(self.sampler), 4 * self.batch_size
        batches = []
        for start in range(0, len(order), pool):
            by_length = sorted(order[start : start + pool], key=self.lengths.__getitem__)
            batches += [by_length[i : i + self.batch_size] for i in range(0, len(by_length), self.batch_size)]
        random.shuffle(batches)
        yield from (batches[place] for place in torch.randperm(len(batches)).tolist())


class MakesLoader(LightningDataModule):
    """A data module making its training loader in `train_dataloader`, as data modules do."""

    def __init__(self, make: Callable[[], DataLoader]) -> None:
        super().__init__()
        self.make = make

    def train_dataloader(self) -> DataLoader:
        return self.make()


def by_length(dataset) -> Callable[[], DataLoader]:
    lengths = [index % 7 for index in range(len(dataset))]
    return lambda: DataLoader(dataset, batch_sampler=ByLength(RandomSampler(dataset), 4, False, lengths))


def epoch(loader: ResumableDataLoader, number: int, trained_before: int = 0) -> list:
    """The batches of epoch `number`, after `trained_before` of them, by the loader a fit used, driven by hand."""
    loader.trainer = None  # its epoch is the one set here, not the finished fit's
    loader.load_state_dict({"epoch": number, "own_batches": trained_before, "processes": 1})
    loader.own_batches.set_epoch(number)  # as its iterator does, from the Trainer's epoch
    return list(loader)


def test_a_loader_with_a_batch_sampler_of_its_own_keeps_it_and_resumes_mid_epoch():
    dataset = random_images(40)
    kept = fit(MakesLoader(by_length(dataset)), batches=1.0)
    loader = kept.loader
    assert isinstance(loader, ResumableDataLoader) and isinstance(loader.batch_sampler, ByLength)
    share = loader.batch_sampler.sampler
    assert type(share) is DistributedSampler and share.shuffle, "one shuffled share, as Lightning gives each process"
    assert (share.num_replicas, share.seed) == (1, 0)
    assert loader.batch_sampler.epochs_set == [0], "Lightning sets only the epoch of the batch sampler's sampler"
    trained = torch.cat([features for features, _ in kept.batches])
    assert torch.equal(trained, torch.cat([features for features, _ in epoch(loader, 0)])), "drawn by the seed"
    assert sorted(trained.flatten(1)[:, 0].tolist()) == sorted(dataset.tensors[0].flatten(1)[:, 0].tolist())

    whole = epoch(loader, 1)
    assert not torch.equal(torch.cat([f for f, _ in whole]), trained), "each epoch its own batches"
    resumed = epoch(loader, 1, trained_before=3)
    assert len(resumed) == len(whole) - 3
    assert all(torch.equal(a[0], b[0]) for a, b in zip(whole[3:], resumed, strict=True))


def test_its_batches_are_drawn_without_moving_the_models_random_draws():
    loader = fit(MakesLoader(by_length(random_images(40))), batches=1).loader
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    expected = [*torch.rand(3).tolist(), random.random(), np.random.rand()]
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    epoch(loader, 2)
    assert [*torch.rand(3).tolist(), random.random(), np.random.rand()] == expected


@pytest.mark.parametrize("workers", [1, 2])
def test_augmentation_in_loader_workers_draws_the_same_after_a_resume_mid_epoch(workers):
    loader = ResumableDataLoader(Jittered(40), batch_sampler=ByLength(RandomSampler(range(40)), 4, False, [0] * 40),
                                 num_workers=workers, seed=3)  # fmt: skip
    whole, resumed = epoch(loader, 1), epoch(loader, 1, trained_before=3)
    assert torch.equal(torch.cat(whole[3:]), torch.cat(resumed)), "other noise after the resume"
    noise = torch.cat(whole).frac()
    assert len(set(noise.tolist())) == len(noise), "every sample its own noise"


class Shuffled:
    """A batch sampler written from scratch, with no `sampler`: one process's, or one that shares itself out (with
    `use_distributed_sampler: false`)."""

    def __len__(self) -> int:
        return 10

    def __iter__(self) -> Iterator[list[int]]:
        return iter(batch.tolist() for batch in torch.randperm(40).split(4))


def test_one_with_no_sampler_resumed_on_another_number_of_processes_starts_the_epoch_over_in_one_line():
    loader = fit(MakesLoader(lambda: DataLoader(random_images(40), batch_sampler=Shuffled())), batches=1).loader
    with pytest.warns(UserWarning) as said:
        loader.load_state_dict({"epoch": 0, "own_batches": 3, "processes": 2})
    assert loader.own_batches.resumed == (0, 0)
    assert [str(warning.message) for warning in said] == [
        "exact resume: the training loader's batch sampler (Shuffled) made batches on 2 processes and is on 1, so a"
        ' resume mid-epoch starts the epoch over (docs/data.md, "Which training loaders resume mid-epoch")'
    ]


def test_a_batch_sampler_with_no_sampler_resumes_mid_epoch_on_one_process():
    loader = fit(MakesLoader(lambda: DataLoader(random_images(40), batch_sampler=Shuffled())), batches=1).loader
    whole, resumed = epoch(loader, 1), epoch(loader, 1, trained_before=3)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(whole[3:], resumed, strict=True))


def test_a_loader_with_a_batch_sampler_made_outside_train_dataloader_is_left_as_it_is_in_one_line():
    dataset = random_images(40)
    made_outside = DataLoader(dataset, batch_sampler=ByLength(RandomSampler(dataset), 4, False, [1] * 40))
    with pytest.warns(UserWarning, match=r"^exact resume: ") as said:
        kept = fit(TrainLoaders(made_outside))
    assert kept.loader is made_outside
    assert [str(warning.message) for warning in said if "exact resume" in str(warning.message)] == [
        "exact resume: the training loader, batched by a batch sampler of its own (ByLength), was made outside"
        " `train_dataloader`, where Lightning records its arguments, so a resume mid-epoch starts the epoch over"
        ' (docs/data.md, "Which training loaders resume mid-epoch")'
    ]


def test_a_batch_sampler_spelled_out_resumes_as_batch_size_and_drop_last(monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    dataset = random_images(42)
    spelled_out = BatchSampler(RandomSampler(dataset), batch_size=4, drop_last=True)
    kept = fit(MakesLoader(lambda: DataLoader(dataset, batch_sampler=spelled_out)), batches=1.0)
    loader = kept.loader
    assert isinstance(loader.sampler, ResumableSampler) and loader.sampler.shuffle
    assert (loader.batch_size, loader.drop_last, len(kept.batches)) == (4, True, 10)
    order = torch.randperm(42, generator=torch.Generator().manual_seed(7))  # DistributedSampler's, for epoch 0
    assert torch.equal(torch.cat([features for features, _ in kept.batches]), dataset.tensors[0][order[:40]])


class MadeInSetup(LightningDataModule):
    """A batch sampler made in `setup`, outside `train_dataloader`: Lightning records no arguments to make it again
    with, and its own `(sampler, batch_size, drop_last)` does not fit ByLength's `lengths`."""

    def setup(self, stage: str) -> None:
        self.dataset = random_images(40)
        self.batches = ByLength(RandomSampler(self.dataset), 4, False, [1] * 40)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_sampler=self.batches)


def test_one_that_cannot_be_made_again_trains_as_it_is_and_starts_the_epoch_over_on_another_number_in_one_line():
    kept = fit(MadeInSetup(), batches=1.0)
    loader = kept.loader
    assert loader.own_batches.remake is None and type(loader.batch_sampler.sampler) is RandomSampler
    assert len(kept.batches) == 10
    whole, resumed = epoch(loader, 1), epoch(loader, 1, trained_before=3)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(whole[3:], resumed, strict=True)), "on as many processes"
    with pytest.warns(UserWarning, match=r"^exact resume: the training loader's batch sampler \(ByLength\) made"):
        loader.load_state_dict({"epoch": 0, "own_batches": 3, "processes": 2})
