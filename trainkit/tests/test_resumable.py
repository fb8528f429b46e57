"""An ordinary training DataLoader, in a data module of the researcher's own, resumes mid-epoch exactly."""

import json
import math
import shutil
import signal
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    Subset,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from trainkit.data.resumable import ResumableData, ResumableDataLoader
from trainkit.data.samplers import DistributedResumableSampler, RandomResumableSampler, ResumableSampler
from trainkit.testing.tiny import TinyClassifier
from trainkit.testing.training_samples import recorded

from .drills import load, paced, start, wait_for, whole_epochs
from .helpers import clean_env, quick_trainer_args, run_train

TRAIN_SIZE, BATCH_SIZE = 200, 8


class TrainLoaders(LightningDataModule):
    """A data module returning whatever training loader it is given (and no validation)."""

    def __init__(self, loader: DataLoader) -> None:
        super().__init__()
        self.loader = loader

    def train_dataloader(self) -> DataLoader:
        return self.loader


class KeepBatches(Callback):
    """Keeps the loader training used and the batches it trained on."""

    def __init__(self) -> None:
        self.batches: list = []

    def on_train_start(self, trainer: Trainer, *args) -> None:
        self.loader = trainer.train_dataloader

    def on_train_batch_start(self, trainer: Trainer, pl_module, batch, batch_idx: int) -> None:
        self.batches.append(batch)


def fit(
    data: LightningDataModule, batches: int | float = 2, model: LightningModule | None = None, *also: Callback
) -> KeepBatches:
    """An epoch of training (its first `batches`) in this process, with the callback every run gets (and `also`)."""
    kept = KeepBatches()
    trainer = Trainer(accelerator="cpu", max_epochs=1, limit_train_batches=batches, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[ResumableData(), kept, *also])  # fmt: skip
    trainer.fit(model or TinyClassifier(), data)
    return kept


def trained_on(run_dir: Path, rank: int) -> dict[int, list[str]]:
    return recorded(run_dir / "samples", rank)


def random_images(size: int) -> TensorDataset:
    return TensorDataset(torch.randn(size, 1, 4, 4), torch.zeros(size, dtype=torch.long))


def stacked(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """A collate_fn of the researcher's own."""
    features, labels = zip(*samples, strict=True)
    return torch.stack(features), torch.stack(labels)


def test_an_ordinary_loader_is_rebuilt_resumable_with_every_argument_it_was_given():
    dataset = random_images(40)
    loader = DataLoader(dataset, batch_size=6, shuffle=False, drop_last=True, collate_fn=stacked, num_workers=1,
                        timeout=30)  # fmt: skip
    data = TrainLoaders(loader)
    kept = fit(data, batches=1.0)

    rebuilt = kept.loader
    assert isinstance(rebuilt, ResumableDataLoader) and isinstance(rebuilt.sampler, ResumableSampler)
    assert rebuilt.dataset is dataset and not rebuilt.sampler.shuffle  # shuffle=False: in the dataset's order
    options = (rebuilt.batch_size, rebuilt.drop_last, rebuilt.collate_fn, rebuilt.num_workers, rebuilt.timeout)
    assert options == (6, True, stacked, 1, 30)
    assert len(kept.batches) == 40 // 6  # the last, short batch dropped
    assert torch.equal(torch.cat([features for features, _ in kept.batches]), dataset.tensors[0][:36])
    assert not {"train_dataloader", "val_dataloader"} & vars(data).keys(), "the data module's own hooks after the fit"


def test_a_shuffled_loader_takes_its_order_from_the_seed_and_the_epoch(monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    dataset = random_images(40)
    kept = fit(TrainLoaders(DataLoader(dataset, batch_size=4, shuffle=True)))
    sampler = kept.loader.sampler
    assert sampler.shuffle and sampler.seed == 7 and sampler.epoch == 0
    order = torch.randperm(40, generator=torch.Generator().manual_seed(7))  # DistributedSampler's, for epoch 0
    assert torch.equal(torch.cat([features for features, _ in kept.batches]), dataset.tensors[0][order[:8]])


@pytest.mark.parametrize("replacement", [False, True], ids=["whole-shuffles", "with-replacement"])
def test_a_random_sampler_of_a_set_number_of_draws_draws_them_from_the_seed_and_resumes_after_those_trained(
    monkeypatch, replacement
):
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    dataset = random_images(40)
    drawn = RandomSampler(dataset, replacement=replacement, num_samples=100)  # epochs of 100 rows, whatever the size
    kept = fit(TrainLoaders(DataLoader(dataset, batch_size=4, sampler=drawn)), batches=1.0)
    sampler = kept.loader.sampler
    assert type(sampler) is RandomResumableSampler
    assert len(kept.batches) == len(kept.loader) == 25, "as many samples an epoch as the sampler draws"
    order = list(sampler)
    assert torch.equal(torch.cat([features for features, _ in kept.batches]), dataset.tensors[0][order])
    if not replacement:  # two whole shuffles of the 40 rows, then 20 rows of a third
        assert sorted(order[:40]) == sorted(order[40:80]) == list(range(40)) and len(set(order[80:])) == 20
    sampler.resumed = (0, 48)
    assert list(sampler) == order[48:], "a resume goes on with the rows after those trained"


def test_a_weighted_loader_draws_from_its_weights_in_an_order_from_the_seed_and_the_epoch(monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    dataset, weights = random_images(40), torch.tensor([0.0, 1.0, 3.0, 0.5] * 10)
    drawn = WeightedRandomSampler(weights, num_samples=24, replacement=True)
    kept = fit(TrainLoaders(DataLoader(dataset, batch_size=4, sampler=drawn)), batches=1.0)
    assert isinstance(kept.loader.sampler, ResumableSampler)
    assert len(kept.batches) == len(kept.loader) == 6, "as many samples an epoch as the sampler draws"
    order = torch.multinomial(weights, 24, replacement=True, generator=torch.Generator().manual_seed(7))  # epoch 0
    assert torch.equal(torch.cat([features for features, _ in kept.batches]), dataset.tensors[0][order])


def test_a_subset_loader_orders_its_indices_only_from_the_seed_and_the_epoch(monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    dataset, split = random_images(40), list(range(10, 30))  # the training split of one dataset by indices
    kept = fit(TrainLoaders(DataLoader(dataset, batch_size=4, sampler=SubsetRandomSampler(split))), batches=1.0)
    assert isinstance(kept.loader.sampler, ResumableSampler)
    assert len(kept.batches) == len(kept.loader) == 5, "as many samples an epoch as the split has"
    order = [split[place] for place in torch.randperm(20, generator=torch.Generator().manual_seed(7))]  # epoch 0
    assert torch.equal(torch.cat([features for features, _ in kept.batches]), dataset.tensors[0][order])


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_distributed_sampler_of_the_data_modules_own_keeps_its_order_and_each_process_its_share(drop_last):
    # Code written for plain PyTorch's DDP shares out its data itself: 41 rows over 3 processes.
    dataset = random_images(41)
    for rank in range(3):
        own = DistributedSampler(dataset, num_replicas=3, rank=rank, seed=5, drop_last=drop_last)
        kept = fit(TrainLoaders(DataLoader(dataset, batch_size=2, sampler=own)), batches=1.0)
        assert type(kept.loader.sampler) is DistributedResumableSampler
        assert torch.equal(torch.cat([features for features, _ in kept.batches]), dataset.tensors[0][list(own)])


class Jittered(Dataset):
    """Numbers with noise added each time one is read, as augmentation adds it: in the worker that reads it."""

    def __init__(self, size: int) -> None:
        self.rows = torch.arange(size, dtype=torch.float)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.rows[index] + torch.rand(())


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("dataset", [Jittered(40), Subset(Jittered(50), range(40))], ids=["per-sample", "batched"])
def test_augmentation_in_loader_workers_draws_the_same_after_a_resume_mid_epoch(dataset, workers):
    # A Subset reads a batch at once (its __getitems__).
    def epoch(trained_before: int) -> list[torch.Tensor]:
        sampler = ResumableSampler(dataset, num_replicas=1, rank=0, seed=3)
        sampler.resumed = (0, trained_before)
        return list(ResumableDataLoader(dataset, batch_size=4, sampler=sampler, num_workers=workers))

    whole, resumed = epoch(0), epoch(3 * 4)
    assert torch.equal(torch.cat(whole[3:]), torch.cat(resumed)), "other noise after the resume"
    noise = torch.cat(whole).frac()
    assert len(set(noise.tolist())) == len(noise), "every sample its own noise"


def test_a_list_read_by_workers_is_read_as_it_is():
    rows = [torch.tensor(float(row)) for row in range(12)]  # no attribute can be added to a list
    sampler = ResumableSampler(rows, num_replicas=1, rank=0, seed=3, shuffle=False)
    assert torch.equal(torch.cat(list(ResumableDataLoader(rows, batch_size=4, sampler=sampler, num_workers=2))),
                       torch.stack(rows))  # fmt: skip


def test_workers_of_a_loader_in_an_order_the_kit_does_not_draw_start_as_the_loader_says():
    # Lightning's `overfit_batches` swaps in a plain sequential sampler: no batch carries a seed then.
    def start(worker_id: int) -> None:
        torch.manual_seed(worker_id)

    loader = ResumableDataLoader(Jittered(8), batch_size=4, sampler=SequentialSampler(range(8)), num_workers=2,
                                 worker_init_fn=start)  # fmt: skip
    assert loader.worker_init_fn is start
    assert len(list(loader)) == 2


def test_a_cycled_loaders_workers_draw_anew_each_pass_and_the_same_after_a_resume():
    dataset = Jittered(16)

    def shorter_loader() -> ResumableDataLoader:  # one of several that Lightning combines, cycling the shorter
        sampler = ResumableSampler(dataset, num_replicas=1, rank=0, seed=3)
        return ResumableDataLoader(dataset, batch_size=4, sampler=sampler, num_workers=2, combined="max_size_cycle")

    cycled = shorter_loader()
    first, second = torch.cat(list(cycled)), list(cycled)
    assert torch.equal(first.floor(), torch.cat(second).floor()), "each pass in the epoch's order"
    assert not torch.equal(first, torch.cat(second)), "the second pass drew the first pass's noise"
    resumed = shorter_loader()
    resumed.load_state_dict({"epoch": 0, "samples": 2 * 4, "passes": 1, "processes": 1})  # mid second pass
    assert torch.equal(torch.cat(list(resumed)), torch.cat(second[2:]))


class Stream(IterableDataset):
    def __iter__(self):
        for _ in range(16):
            yield torch.randn(1, 4, 4), torch.tensor(0)


@pytest.mark.parametrize(
    ("loader", "reason"),
    [
        (DataLoader(Stream(), batch_size=4), "reads an IterableDataset and keeps no state"),
        (
            DataLoader(random_images(40), batch_size=4, sampler=[5, 0, 7, 2, 9, 1, 3, 4]),
            "uses a sampler of its own (list)",
        ),
        (
            DataLoader(random_images(40), batch_sampler=iter([[1, 2], [3, 4]])),
            "uses a batch sampler of its own (list_iterator) with no length",
        ),
    ],
    ids=["iterable-dataset", "own-sampler", "own-batch-sampler"],
)
def test_loaders_with_an_order_of_their_own_are_left_as_they_are_in_one_line(loader, reason):
    with pytest.warns(UserWarning, match=r"^exact resume: the training loader ") as said:
        kept = fit(TrainLoaders(loader))
    assert kept.loader is loader
    assert [str(warning.message) for warning in said if "exact resume" in str(warning.message)] == [
        f"exact resume: the training loader {reason}, so a resume mid-epoch starts the epoch over"
        ' (docs/data.md, "Which training loaders resume mid-epoch")'
    ]


class StreamLoader(DataLoader):
    """A loader of a stream that keeps its own state: how many batches it has handed out."""

    def __iter__(self):
        for batch in super().__iter__():
            self.handed_out += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"handed_out": self.handed_out}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.handed_out = state["handed_out"]


class SizedStream(Stream):
    def __len__(self) -> int:
        return 16


class KeepStates(Callback):
    def __init__(self) -> None:
        self.states: list[int] = []

    def on_train_batch_end(self, trainer: Trainer, *args) -> None:  # where a checkpoint after the step would save
        self.states.append(trainer.train_dataloader.state_dict()["handed_out"])


@pytest.mark.parametrize("dataset", [Stream, SizedStream], ids=["no-length", "a-length"])
def test_a_loader_that_keeps_its_own_state_with_no_length_is_said_to_skip_a_batch(dataset):
    loader = StreamLoader(dataset(), batch_size=4)
    loader.handed_out = 0
    states = KeepStates()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        fit(TrainLoaders(loader), 1.0, None, states)
    exact_resume = [str(warning.message) for warning in said if str(warning.message).startswith("exact resume")]
    if dataset is Stream:  # Lightning fetched each next batch before the step: the state is one batch on
        assert states.states == [2, 3, 4, 4]
        assert exact_resume == ["exact resume: the training loader keeps its own state but has no length: Lightning"
                                " fetches a batch ahead of the one it trains on (to tell which is the last), so a"
                                " checkpoint keeps the loader's state one batch on, and a resume mid-epoch skips a"
                                " batch. Give the dataset `__len__`"
                                ' (docs/data.md, "Which training loaders resume mid-epoch")']  # fmt: skip
    else:
        assert states.states == [1, 2, 3, 4]
        assert exact_resume == []


class TrainsOnEach(TinyClassifier):
    def training_step(self, batches: dict, batch_idx: int) -> torch.Tensor:
        return sum(super(TrainsOnEach, self).training_step(batch, batch_idx) for batch in batches.values())


class KeepPlaces(Callback):
    """Keeps the state each training loader would save in a checkpoint, before each batch."""

    def __init__(self) -> None:
        self.places: list[dict] = []

    def on_train_batch_start(self, trainer: Trainer, *args) -> None:
        loaders = trainer.fit_loop._combined_loader.iterables
        self.places.append({name: loader.state_dict()["samples"] for name, loader in loaders.items()})


def labeled_and_unlabeled() -> dict[str, DataLoader]:
    """Semi-supervised training data: 4 shuffled batches of labeled images and 10 of unlabeled ones."""
    return {"labeled": DataLoader(random_images(16), batch_size=4, shuffle=True),
            "unlabeled": DataLoader(random_images(40), batch_size=4, shuffle=True)}  # fmt: skip


def test_several_training_loaders_are_each_rebuilt_and_keep_their_place_in_their_own_pass():
    # Lightning combines the loaders, cycling the shorter one ("max_size_cycle").
    loaders = labeled_and_unlabeled()
    labeled = loaders["labeled"].dataset
    places = KeepPlaces()
    kept = fit(TrainLoaders(loaders), 1.0, TrainsOnEach(), places)

    assert all(isinstance(loader, ResumableDataLoader) and loader.combined for loader in kept.loader.values())
    assert len(kept.batches) == 10, "an epoch is the longer loader's"
    passes = [torch.cat([batch["labeled"][0] for batch in kept.batches[start : start + 4]]) for start in (0, 4)]
    assert torch.equal(passes[0], passes[1]), "each pass of the shorter loader in the epoch in the epoch's order"
    assert sorted(passes[0].flatten().tolist()) == sorted(labeled.tensors[0].flatten().tolist())
    # Before batch k, the job has trained on k batches of the unlabeled and k % 4 of the labeled loader's pass.
    assert places.places == [{"labeled": k % 4 * 4, "unlabeled": k * 4} for k in range(10)]


def test_loaders_combined_up_to_the_shortest_are_each_rebuilt_and_keep_their_place():
    loaders = CombinedLoader(labeled_and_unlabeled(), mode="min_size")
    places = KeepPlaces()
    fit(TrainLoaders(loaders), 1.0, TrainsOnEach(), places)
    assert all(isinstance(loader, ResumableDataLoader) for loader in loaders.flattened)
    assert places.places == [{"labeled": k * 4, "unlabeled": k * 4} for k in range(4)], "an epoch is the shorter's"


def test_loaders_combined_where_one_that_ran_out_gives_none_are_left_as_they_are_in_one_line():
    loaders = CombinedLoader(labeled_and_unlabeled(), mode="max_size")
    with pytest.warns(UserWarning, match=r"^exact resume: the training loaders ") as said:
        kept = fit(TrainLoaders(loaders), batches=4, model=TrainsOnEach())  # before the shorter one runs out
    assert not any(isinstance(loader, ResumableDataLoader) for loader in kept.loader.values())
    assert [str(warning.message) for warning in said if "exact resume" in str(warning.message)] == [
        'exact resume: the training loaders are combined in mode "max_size", where a loader that ran out gives None,'
        ' so a resume mid-epoch starts the epoch over (docs/data.md, "Which training loaders resume mid-epoch")'
    ]


@pytest.mark.slow
def test_sigterm_mid_epoch_then_the_same_command_trains_the_same_weights(experiment, tmp_path):
    """A data module returning `DataLoader(dataset, batch_size=8, shuffle=True)` with 2 workers kept between epochs
    (`persistent_workers`, as many do), on one process, preempted and restarted. On 2 processes, these loaders
    resume with workers in test_rng_per_process, and the contract's pairs' own loaders in its drills."""
    # Configs of their own, every argument given (JSON is YAML too).
    model, data = tmp_path / "model.yaml", tmp_path / "data.yaml"
    tiny_model = {"hidden": 32, "dropout": 0.3, "lr": 0.01}
    tiny_data = {"train_size": TRAIN_SIZE, "val_size": 32, "test_size": 32, "batch_size": BATCH_SIZE,
                 "num_workers": 2}  # fmt: skip
    model.write_text(json.dumps({"class_path": "trainkit.testing.tiny.TinyClassifier", "init_args": tiny_model}))
    data.write_text(json.dumps({"class_path": "trainkit.testing.tiny.TinyDataModule", "init_args": tiny_data}))

    def args(run: str, *extra: str) -> list[str]:
        return ["fit", "--config", str(experiment),
                "--model", str(model), "--data", str(data), *quick_trainer_args(tmp_path / run), *whole_epochs(2),
                "--trainer.devices", "1",
                "--trainer.callbacks+=trainkit.testing.training_samples.RecordTrainingSamples",
                "--trainer.callbacks.out_dir", str(tmp_path / run / "samples"), *extra]  # fmt: skip

    uninterrupted = run_train(*args("uninterrupted"))
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-4000:]
    first_epoch = trained_on(tmp_path / "uninterrupted", 0)[0]
    assert len(set(first_epoch)) == len(first_epoch) == TRAIN_SIZE, "each sample once an epoch"

    marker, log = tmp_path / "step-5", tmp_path / "interrupted.log"
    job = start(args("resumed", *paced(marker, at_step=5)), clean_env(), log)
    wait_for(marker, job, log)
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=60) == 143, log.read_text()[-4000:]
    steps_per_epoch = math.ceil(TRAIN_SIZE / BATCH_SIZE)
    stopped_at = load(tmp_path / "resumed" / "checkpoints" / "preempted.ckpt")["global_step"]
    assert stopped_at % steps_per_epoch, "the interruption must land mid-epoch"

    resumed = run_train(*args("resumed"))
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-4000:]
    assert "preempted.ckpt" in output and "not resumable" not in output

    expected, actual = (trained_on(tmp_path / run, 0) for run in ("uninterrupted", "resumed"))
    assert actual == expected, "trained on other samples, or in another order, after resuming"
    expected, actual = (load(tmp_path / run / "checkpoints" / "last.ckpt") for run in ("uninterrupted", "resumed"))
    assert actual["global_step"] == expected["global_step"] == 2 * steps_per_epoch
    for name, tensor in expected["state_dict"].items():
        assert torch.equal(tensor, actual["state_dict"][name]), f"{name} differs after resuming"


def test_a_stateful_loader_of_the_projects_own_resumes_each_process_from_its_own_state(experiment, tmp_path):
    """A stream that each of 2 processes reads its own share of, by a loader that keeps its place in it
    (tasks/streamed.py), preempted mid-epoch and resumed: each process trains on its own rows, as without the stop.
    Lightning keeps the first process's state only, and the second would have read the first's share."""

    def args(run: str, *extra: str) -> list[str]:
        return ["fit", "--config", str(experiment), "--model", "tasks.streamed.RegressorOfAStream",
                "--data", "tasks.streamed.StreamedTable", "--best_checkpoint.monitor", "val_loss",
                *quick_trainer_args(tmp_path / run), *whole_epochs(2), "--trainer.devices", "2",
                "--trainer.callbacks+=trainkit.testing.training_samples.RecordTrainingSamples",
                "--trainer.callbacks.out_dir", str(tmp_path / run / "samples"), *extra]  # fmt: skip

    uninterrupted = run_train(*args("uninterrupted"), timeout=300)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-4000:]
    marker, log = tmp_path / "step-3", tmp_path / "interrupted.log"
    job = start(args("resumed", *paced(marker, at_step=3)), clean_env(), log)
    wait_for(marker, job, log)
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=120) == 143, log.read_text()[-4000:]
    stopped_at = load(tmp_path / "resumed" / "checkpoints" / "preempted.ckpt")["global_step"]
    assert stopped_at % 10 > 0, "the interruption must land mid-epoch (10 steps an epoch)"
    shutil.copytree(tmp_path / "resumed" / "checkpoints", tmp_path / "on-one-process" / "checkpoints")

    resumed = run_train(*args("resumed"), timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    for rank in (0, 1):
        expected, actual = (trained_on(tmp_path / run, rank) for run in ("uninterrupted", "resumed"))
        assert actual == expected, f"global rank {rank} trained on other rows after resuming"
    expected, actual = (load(tmp_path / run / "checkpoints" / "last.ckpt") for run in ("uninterrupted", "resumed"))
    for name, tensor in expected["state_dict"].items():
        assert torch.equal(tensor, actual["state_dict"][name]), f"{name} differs after resuming"

    # On 1 process there is no state of its own: it resumes from the first process's, and says so.
    one = run_train(*args("on-one-process"), "--trainer.devices", "1")
    assert one.returncode == 0, one.stderr[-4000:]
    said = "exact resume: the training loader keeps a state of each process's own, saved by 2 processes: on 1 each"
    assert f"{said} process resumes from the first one's" in one.stdout + one.stderr, one.stderr[-4000:]
