"""A job restarted on another number of processes goes on with the interrupted epoch: every sample it had not
trained on yet, once, shared out over the new processes."""

import logging
import math
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningDataModule, Trainer
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, TensorDataset

from trainkit.data.generators import cpu_generators_seeded
from trainkit.data.resumable import ResumableData
from trainkit.data.samplers import ResumableSampler, WeightedResumableSampler
from trainkit.data.streaming import StreamingImageDataModule
from trainkit.data.worker_seeds import seed_of
from trainkit.testing.runs import signal_at
from trainkit.testing.tiny import TinyClassifier, TinyDataModule
from trainkit.testing.training_samples import recorded, sample_ids

from .conftest import streaming_run_args
from .drills import load, paced, start, wait_for, whole_epochs
from .helpers import clean_env, quick_run_args, quick_trainer_args, run_train
from .test_own_batches import ByLength
from .test_resumable import TrainsOnEach

TRAIN_SIZE = 576  # the tiny data's training images
# Batches that share every number of processes here out evenly: in memory each process takes its share in batches
# of 16; streamed, each of its loader workers takes a share of that in batches of 8.
BATCH_SIZE = {"in memory": 16, "streamed": 8}


def training_sample_ids(data: str, tiny_chunks: Path) -> list[str]:
    """The ids RecordTrainingSamples gives the training images, normalised as the data path normalises them."""
    tiny = TinyDataModule()
    tiny.setup("fit")
    module = tiny if data == "in memory" else StreamingImageDataModule(input_dir=str(tiny_chunks))
    return sample_ids(module.on_after_batch_transfer(tiny.train_set.tensors, dataloader_idx=0)[0])


def samplers(size: int, processes: int, trained: int = 0, epoch: int = 3) -> list[ResumableSampler]:
    """Every process's sampler in an epoch the job had trained on `trained` samples of before this run."""
    samplers = [ResumableSampler(range(size), processes, rank, seed=7) for rank in range(processes)]
    for sampler in samplers:
        sampler.set_epoch(epoch)
        sampler.resumed = (epoch, trained)
    return samplers


@pytest.mark.parametrize(("before", "after"), [(1, 2), (4, 2), (2, 3), (3, 1)])
@pytest.mark.parametrize("size", [96, 100])
def test_the_rest_of_an_epoch_is_shared_out_once_over_any_number_of_processes(before, after, size):
    batch_size, batches = 4, 3
    trained = [sample for sampler in samplers(size, before) for sample in list(sampler)[: batches * batch_size]]
    rest = samplers(size, after, trained=len(trained))
    shares = [list(sampler) for sampler in rest]
    for sampler, share in zip(rest, shares, strict=True):
        assert len(share) == len(shares[0]), "as many samples on every process"
        assert sampler.batches_left(batch_size, drop_last=False) == math.ceil(len(share) / batch_size)
        assert sampler.batches_left(batch_size, drop_last=True) == len(share) // batch_size
    resumed = Counter(trained + [sample for share in shares for sample in share])
    assert set(resumed) == set(range(size)), "samples left out"
    # Twice only to give every process as many, as DistributedSampler does: never when the rest shares out evenly.
    assert sum(resumed.values()) - size == -(size - len(trained)) % after


def weighted_samplers(processes: int, trained: int = 0, draws: int = 90) -> list[WeightedResumableSampler]:
    """As `samplers`, drawing `draws` samples of 50 by weight, with replacement."""
    weights = torch.linspace(0.1, 1.0, 50)
    samplers = [WeightedResumableSampler(range(50), weights, draws, replacement=True, num_replicas=processes,
                                         rank=rank, seed=7) for rank in range(processes)]  # fmt: skip
    for sampler in samplers:
        sampler.set_epoch(3)
        sampler.resumed = (3, trained)
    return samplers


@pytest.mark.parametrize(("before", "after"), [(1, 2), (2, 3), (3, 1)])
def test_the_rest_of_a_weighted_epoch_is_the_draws_not_trained_on_yet(before, after):
    draws, batch_size, batches = 90, 4, 3
    order = list(weighted_samplers(1)[0])
    assert len(order) == draws
    trained = [sample for sampler in weighted_samplers(before) for sample in list(sampler)[: batches * batch_size]]
    assert sorted(trained) == sorted(order[: len(trained)]), "the processes' first batches: the order's start"
    rest = weighted_samplers(after, trained=len(trained))
    shares = [list(sampler) for sampler in rest]
    assert {len(share) for share in shares} == {rest[0].batches_left(1, drop_last=False)}, "as many on every process"
    # The draws left, and as DistributedSampler does, a few from the order's start to give every process as many.
    again = -(draws - len(trained)) % after
    assert sorted(sample for share in shares for sample in share) == sorted(order[len(trained) :] + order[:again])


def test_an_epoch_goes_on_as_distributed_samplers_on_as_many_processes():
    for rank, sampler in enumerate(samplers(100, 3)):
        distributed = DistributedSampler(range(100), num_replicas=3, rank=rank, seed=7)
        distributed.set_epoch(3)
        assert list(sampler) == list(distributed)
        resumed = samplers(100, 3, trained=2 * 4 * 3)[rank]  # 2 batches of 4 on each of 3 processes
        assert list(resumed) == list(distributed)[2 * 4 :]
        assert resumed.batches_left(4, drop_last=False) == math.ceil(len(distributed) / 4) - 2


class Images(LightningDataModule):
    """Shuffled training images in batches of 4 (and no validation)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.images = torch.randn(size, 1, 4, 4)

    def train_dataloader(self) -> DataLoader:
        labels = torch.zeros(len(self.images), dtype=torch.long)
        return DataLoader(TensorDataset(self.images, labels), batch_size=4, shuffle=True)


class KeepBatches(Callback):
    """Keeps the batches a run trains on; saves a checkpoint after step `save_at`, as a preemption does."""

    def __init__(self, save_at: int, checkpoint: Path) -> None:
        self.save_at, self.checkpoint = save_at, checkpoint
        self.trained: list[Any] = []

    def on_train_batch_start(self, trainer: Trainer, pl_module, batch, batch_idx: int) -> None:
        self.trained.append(batch)

    def on_train_batch_end(self, trainer: Trainer, *args) -> None:
        if trainer.global_step == self.save_at:
            trainer.save_checkpoint(self.checkpoint)


def fit(
    data: LightningDataModule,
    ckpt_path: Path | None,
    save_at: int,
    checkpoint: Path,
    epochs: int = 1,
    loader: str | None = None,
) -> tuple[Trainer, torch.Tensor]:
    """An epoch in this process, with the callback every run gets; the images it trained on (those of the training
    loader named `loader`, where the data module has several)."""
    kept = KeepBatches(save_at, checkpoint)
    trainer = Trainer(accelerator="cpu", max_epochs=epochs, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[ResumableData(), kept])  # fmt: skip
    trainer.fit(TrainsOnEach() if loader else TinyClassifier(), data, ckpt_path=ckpt_path)
    return trainer, torch.cat([(batch[loader] if loader else batch)[0] for batch in kept.trained])


def place(checkpoint: dict) -> dict[str, int]:
    """Where the training loader's state in `checkpoint` says the job stood."""
    (state,) = places(checkpoint)
    return state


def places(checkpoint: dict) -> list[dict[str, int]]:
    """Where each training loader's state in `checkpoint` says the job stood, in Lightning's order of the loaders."""
    return checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]


def test_a_resharded_epoch_keeps_the_jobs_place_and_ends_after_its_last_sample(monkeypatch, caplog, tmp_path):
    """Preempted after 3 batches on each of 2 processes, then resumed on 1 (and preempted again after 2 batches)."""
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    data, first, second = Images(96), tmp_path / "first.ckpt", tmp_path / "second.ckpt"
    order = data.images[torch.randperm(96, generator=torch.Generator().manual_seed(7))]  # epoch 0's
    fit(data, None, save_at=3, checkpoint=first)
    checkpoint = load(first)
    assert place(checkpoint) == {"epoch": 0, "samples": 3 * 4, "processes": 1}
    place(checkpoint).update(samples=3 * 4 * 2, processes=2)  # as 2 processes would have saved it after 3 batches
    torch.save(checkpoint, first)

    with caplog.at_level(logging.INFO):
        trainer, trained = fit(data, first, save_at=5, checkpoint=second)
    resharded = "resharded: the interrupted epoch goes on over 1 process instead of 2 (72 samples left, each once)"
    assert resharded in caplog.text
    assert torch.equal(trained, order[24:])
    assert trainer.global_step == 3 + 72 // 4
    assert place(load(second)) == {"epoch": 0, "samples": 32, "processes": 1}, "the job's place, not this run's"

    trainer, trained = fit(data, second, save_at=-1, checkpoint=second)
    assert torch.equal(trained, order[32:])
    assert trainer.global_step == 5 + (96 - 32) // 4


class ImagesByLength(Images):
    """The 96 images batched by a batch sampler of the data module's own (pools of 4 batches sorted by a length)."""

    def train_dataloader(self) -> DataLoader:
        dataset = TensorDataset(self.images, torch.zeros(len(self.images), dtype=torch.long))
        return DataLoader(dataset, batch_sampler=ByLength(RandomSampler(dataset), 4, False, LENGTHS))


LENGTHS = [index % 7 for index in range(96)]


def trained_by_two_processes(images: torch.Tensor, batches: int) -> list[str]:
    """The images 2 processes trained on in their first `batches` batches of epoch 0, each over its share."""
    trained = []
    for rank in range(2):
        share = DistributedSampler(range(len(images)), num_replicas=2, rank=rank, shuffle=True, seed=7)
        with cpu_generators_seeded(seed_of(7, 0)):  # as each process draws its epoch's batches
            drawn = list(ByLength(share, 4, False, LENGTHS))
        trained += sample_ids(images[[index for batch in drawn[:batches] for index in batch]])
    return trained


def test_a_batch_sampler_of_its_own_goes_on_with_the_rest_of_every_old_processs_batches(monkeypatch, caplog, tmp_path):
    """As if preempted after 3 batches on each of 2 processes, resumed on 1 and preempted again after 5 batches."""
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    data, first, second = ImagesByLength(96), tmp_path / "first.ckpt", tmp_path / "second.ckpt"
    fit(data, None, save_at=3, checkpoint=first)
    checkpoint = load(first)
    assert place(checkpoint) == {"epoch": 0, "own_batches": 3, "processes": 1}
    place(checkpoint).update(processes=2)
    torch.save(checkpoint, first)

    with caplog.at_level(logging.INFO):
        trainer, trained = fit(data, first, save_at=3 + 5, checkpoint=second)
    assert "resharded: the interrupted epoch goes on over 1 process instead of 2 (72 samples left, each once)" in (
        caplog.text
    )
    assert trainer.global_step == 3 + 72 // 4
    assert Counter(trained_by_two_processes(data.images, 3) + sample_ids(trained)) == Counter(sample_ids(data.images))
    assert place(load(second)) == {"epoch": 0, "own_batches": 5, "processes": 1, "went_on": [[2, 3]]}

    trainer, after_second_stop = fit(data, second, save_at=-1, checkpoint=second)
    assert torch.equal(after_second_stop, trained[5 * 4 :]), "on as many processes, the next batch"
    assert trainer.global_step == 3 + 72 // 4


class UnlabeledAndLabeled(LightningDataModule):
    """Two training loaders, shuffled in batches of 4: 96 images and 40, the shorter one cycled by Lightning."""

    def __init__(self) -> None:
        super().__init__()
        self.images = {"unlabeled": torch.randn(96, 1, 4, 4), "labeled": torch.randn(40, 1, 4, 4)}

    def train_dataloader(self) -> dict[str, DataLoader]:
        return {name: DataLoader(TensorDataset(images, torch.zeros(len(images), dtype=torch.long)), batch_size=4,
                                 shuffle=True) for name, images in self.images.items()}  # fmt: skip


def test_combined_loaders_go_on_with_the_longers_epoch_and_the_shorters_pass_on_another_number_of_processes(
    monkeypatch, caplog, tmp_path
):
    """As if preempted after 6 steps of 2 processes (12 batches of the 96, 5 of the 40 each: the 40's second pass
    begun), resumed on 1 process and preempted again after 10 steps, then resumed again."""
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    data, first, second = UnlabeledAndLabeled(), tmp_path / "first.ckpt", tmp_path / "second.ckpt"
    order = {name: images[torch.randperm(len(images), generator=torch.Generator().manual_seed(7))]
             for name, images in data.images.items()}  # fmt: skip
    fit(data, None, save_at=3, checkpoint=first, loader="labeled")
    checkpoint = load(first)
    assert places(checkpoint) == [{"epoch": 0, "samples": 12, "passes": 0, "processes": 1}] * 2
    places(checkpoint)[0].update(samples=6 * 4 * 2, processes=2)
    places(checkpoint)[1].update(samples=(6 - 5) * 4 * 2, passes=1, processes=2)
    torch.save(checkpoint, first)

    with caplog.at_level(logging.INFO):
        trainer, labeled = fit(data, first, save_at=3 + 10, checkpoint=second, loader="labeled")
    assert "resharded: the interrupted epoch goes on over 1 process instead of 2 (48 samples left, each once)" in (
        caplog.text
    )
    assert trainer.global_step == 3 + 48 // 4, "the rest of the 96 images' epoch"
    assert torch.equal(labeled, torch.cat([order["labeled"][8:], order["labeled"][:16]])), "its pass, then another"
    assert places(load(second)) == [{"epoch": 0, "samples": 48 + 10 * 4, "passes": 0, "processes": 1},
                                    {"epoch": 0, "samples": 2 * 4, "passes": 2, "processes": 1}]  # fmt: skip

    trainer, unlabeled = fit(data, second, save_at=-1, checkpoint=second, loader="unlabeled")
    assert torch.equal(unlabeled, order["unlabeled"][88:])
    assert trainer.global_step == 3 + 10 + 2


def test_a_checkpoint_that_counted_one_process_batches_resumes_as_written_on_as_many(monkeypatch, tmp_path):
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    data, checkpoint_path = Images(96), tmp_path / "older.ckpt"
    order = data.images[torch.randperm(96, generator=torch.Generator().manual_seed(7))]
    fit(data, None, save_at=3, checkpoint=checkpoint_path)
    checkpoint = load(checkpoint_path)
    place(checkpoint).clear()
    place(checkpoint).update(epoch=0, batches=3)  # what checkpoints kept before a job could resume on other processes
    torch.save(checkpoint, checkpoint_path)
    trainer, trained = fit(data, checkpoint_path, save_at=-1, checkpoint=checkpoint_path)
    assert torch.equal(trained, order[12:]) and trainer.global_step == 96 // 4


def test_a_streamed_epoch_goes_on_with_each_sample_once_on_another_layout_and_after_a_second_stop(
    monkeypatch, tiny_chunks, tmp_path
):
    """Stopped after 3 batches of 8 from 2 loader workers; resumed with no workers in batches of 5 (litdata itself
    would go on from a whole batch of that layout, and in whole batches of it), stopped again after 20 of them and
    resumed as that; the next epoch is litdata's own again."""
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    first, second = tmp_path / "first.ckpt", tmp_path / "second.ckpt"

    def data(batch_size: int, num_workers: int) -> StreamingImageDataModule:
        return StreamingImageDataModule(input_dir=str(tiny_chunks), batch_size=batch_size, num_workers=num_workers)

    _, interrupted = fit(data(8, 2), None, save_at=3, checkpoint=first)
    _, going_on = fit(data(5, 0), first, save_at=3 + 20, checkpoint=second)
    trainer, resumed = fit(data(5, 0), second, save_at=-1, checkpoint=second, epochs=2)
    assert torch.equal(resumed[: len(going_on) - 20 * 5], going_on[20 * 5 :]), "the same rest, wherever it stopped"
    epoch = Counter(sample_ids(torch.cat([interrupted[: 3 * 8], going_on[: 20 * 5], resumed[: len(going_on) - 100]])))
    assert epoch == Counter(training_sample_ids("streamed", tiny_chunks)), "each sample of the epoch once"
    assert trainer.global_step == 3 + math.ceil((TRAIN_SIZE - 3 * 8) / 5) + 575 // 5  # litdata's next epoch: 575 of 5
    assert len(set(sample_ids(resumed[len(going_on) - 100 :]))) == 575


@pytest.mark.slow
@pytest.mark.parametrize(
    ("data", "before", "after", "workers", "batch_before"),
    # More processes and fewer, each way of loading once: the same arithmetic maps a place to any layout.
    [("in memory", 4, 2, 2, 16), ("streamed", 1, 2, 2, 18), ("streamed", 2, 1, 0, 8)],
    ids=["in-memory-4-to-2", "streamed-1-to-2", "streamed-2-to-1-no-workers"],
)  # fmt: skip
def test_a_restart_on_other_processes_trains_on_the_rest_of_the_epoch_once(
    data, before, after, workers, batch_before, experiment, tiny_chunks, tmp_path
):
    """Streamed from 1 process in batches of 18, the stop (a few steps in) falls inside a batch of the new layout
    (2 processes x 2 workers x 8): where litdata alone would go on from the last place where one ended."""
    run_dir, batch_size = tmp_path / "run", BATCH_SIZE[data]

    def args(devices: int, batch: int, *extra: str) -> list[str]:
        if data == "in memory":
            run_args = quick_run_args(experiment, run_dir)
        else:
            run_args = streaming_run_args(experiment, tiny_chunks, run_dir)
        return ["fit", *run_args, *whole_epochs(1), "--trainer.devices", str(devices),
                "--data.batch_size", str(batch), "--data.num_workers", str(workers),
                "--trainer.callbacks+=trainkit.testing.training_samples.RecordTrainingSamples",
                "--trainer.callbacks.out_dir", str(run_dir / "samples"), *extra]  # fmt: skip

    marker, log = tmp_path / "step-3", tmp_path / "interrupted.log"
    job = start(args(before, batch_before, *paced(marker, at_step=3)), clean_env(), log)
    wait_for(marker, job, log)
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=60) == 143, log.read_text()[-4000:]
    stopped_at = load(run_dir / "checkpoints" / "preempted.ckpt")["global_step"]
    assert 0 < stopped_at < TRAIN_SIZE // before // batch_before, "the interruption must land mid-epoch"
    trained_before = stopped_at * before * batch_before
    if batch_before != batch_size:
        assert trained_before % (after * workers * batch_size), "the stop must fall inside a batch of the new layout"

    resumed = run_train(*args(after, batch_size))
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-4000:]
    left = TRAIN_SIZE - trained_before
    resharded = f"resharded: the interrupted epoch goes on over {after} process{'es' * (after > 1)} instead of {before}"
    assert f"{resharded} ({left} samples left, each once)" in output, output[-4000:]

    trained = Counter(sample for rank in range(max(before, after)) for sample in recorded(run_dir / "samples", rank)[0])
    assert trained == Counter(training_sample_ids(data, tiny_chunks)), "each sample of the epoch once"
    steps_left = math.ceil(left / after / batch_size)
    assert load(run_dir / "checkpoints" / "last.ckpt")["global_step"] == stopped_at + steps_left


@pytest.mark.slow
def test_a_restart_on_another_number_of_processes_goes_on_with_combined_loaders(tmp_path):
    """The semi-supervised pair (320 rows and 80 labeled ones, in batches of 6: 27 steps of 2 processes, the labeled
    loader's pass 7 of them) stopped mid-epoch on 2 processes, then on 1: the rest of the 320 rows' epoch."""
    run_dir = tmp_path / "run"

    def args(devices: int, *extra: str) -> list[str]:
        return ["fit", "--config", "configs/experiment.yaml", "--model", "tasks.regression.SemiSupervisedRegressor",
                "--data", "tasks.regression.LabeledAndUnlabeled", "--data.batch_size", "6",
                "--best_checkpoint.monitor", "val_loss", *quick_trainer_args(run_dir), *whole_epochs(1),
                "--trainer.devices", str(devices), *extra]  # fmt: skip

    marker, log = tmp_path / "step-8", tmp_path / "interrupted.log"
    job = start(args(2, *paced(marker, at_step=8)), clean_env(), log)
    wait_for(marker, job, log)
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=60) == 143, log.read_text()[-4000:]
    preempted = load(run_dir / "checkpoints" / "preempted.ckpt")
    stopped_at = preempted["global_step"]
    assert 8 <= stopped_at < 27 and stopped_at % 7, "the interruption must land mid-epoch, inside a labeled pass"
    assert places(preempted) == [
        {"epoch": 0, "samples": stopped_at % 7 * 12, "passes": stopped_at // 7, "processes": 2},
        {"epoch": 0, "samples": stopped_at * 12, "passes": 0, "processes": 2},
    ]

    resumed = run_train(*args(1))
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-4000:]
    left = 320 - stopped_at * 12
    assert f"resharded: the interrupted epoch goes on over 1 process instead of 2 ({left} samples left, each once)" in (
        output
    ), output[-4000:]
    assert "exact resume" not in output
    assert load(run_dir / "checkpoints" / "last.ckpt")["global_step"] == stopped_at + math.ceil(left / 6)


@pytest.mark.slow
def test_a_restart_on_other_processes_goes_on_with_a_batch_sampler_of_the_data_modules_own(experiment, tmp_path):
    """The tiny images batched by brightness (a batch sampler of the data module's own, in batches of 16): stopped
    after 3 steps on 2 processes, after 5 more on 1, then to the epoch's end on 2 with 2 loader workers each."""
    run_dir = tmp_path / "run"

    def args(devices: int, workers: int, *extra: str) -> list[str]:
        return ["fit", *quick_run_args(experiment, run_dir), "--data", "tasks.bucketed.TinyByBrightness",
                "--data.batch_size", "16", "--data.num_workers", str(workers), *whole_epochs(1),
                "--trainer.devices", str(devices),
                "--trainer.callbacks+=trainkit.testing.training_samples.RecordTrainingSamples",
                "--trainer.callbacks.out_dir", str(run_dir / "samples"), *extra]  # fmt: skip

    def run(devices: int, workers: int, *extra: str) -> str:
        done = run_train(*args(devices, workers, *extra))
        output = done.stdout + done.stderr
        assert done.returncode == (143 if extra else 0), output[-4000:]
        assert "exact resume" not in output
        return output

    run(2, 0, *paced(tmp_path / "marker", at_step=3), *signal_at(3))  # 2 processes stop at their next agreement
    stopped_at = load(run_dir / "checkpoints" / "preempted.ckpt")["global_step"]
    assert 3 <= stopped_at < 15, "the stop must land mid-epoch, 5 batches before the end of its rest on 1 process"
    left = TRAIN_SIZE - stopped_at * 2 * 16
    output = run(1, 0, *signal_at(stopped_at + 5))
    assert f"over 1 process instead of 2 ({left} samples left, each once)" in output, output[-4000:]
    output = run(2, 2)
    assert f"over 2 processes instead of 1 ({left - 5 * 16} samples left, each once)" in output, output[-4000:]

    trained = Counter(sample for rank in range(2) for sample in recorded(run_dir / "samples", rank)[0])
    assert trained == Counter(training_sample_ids("in memory", tmp_path)), "each sample of the epoch once"
