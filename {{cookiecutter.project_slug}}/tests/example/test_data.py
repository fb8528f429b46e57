import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader
from torchvision.datasets import MNIST
from trainkit.run.errors import ConfigError
from trainkit.testing.runs import load, paced, wait_for, whole_epochs
from trainkit.testing.training_samples import recorded, sample_ids

from {{ cookiecutter.package_name }}.data.mnist import MEAN, STD, InMemoryDataset, MNISTDataModule, already_batched

from ..conftest import clean_env, run_train, start
from .conftest import mnist_run_args


def test_train_and_val_split_the_training_files(mnist_dir):
    data = MNISTDataModule(data_dir=str(mnist_dir), download=False, val_fraction=0.25, batch_size=16)
    data.prepare_data()
    data.setup("fit")
    assert (len(data.train_set), len(data.val_set)) == (480, 160)
    images, labels = next(iter(data.train_dataloader()))
    assert images.shape == (16, 1, 28, 28) and images.dtype == torch.uint8
    assert labels.shape == (16,) and labels.dtype == torch.int64


def test_split_depends_only_on_the_split_seed(mnist_dir):
    def val_labels(split_seed: int) -> torch.Tensor:
        torch.manual_seed(split_seed + 100)  # the global seed must not matter
        data = MNISTDataModule(data_dir=str(mnist_dir), download=False, split_seed=split_seed)
        data.setup("fit")
        return data.val_set.tensors[1]

    assert torch.equal(val_labels(0), val_labels(0))
    assert not torch.equal(val_labels(0), val_labels(1))


def test_test_split_reads_the_test_files(mnist_dir):
    data = MNISTDataModule(data_dir=str(mnist_dir), download=False)
    data.setup("test")
    assert len(data.test_set) == 160


def test_batches_are_normalised_after_transfer(mnist_dir):
    data = MNISTDataModule(data_dir=str(mnist_dir), download=False)
    images = torch.tensor([[[[0, 255]]]], dtype=torch.uint8)
    normalised, _ = data.on_after_batch_transfer((images, torch.tensor([3])), dataloader_idx=0)
    assert normalised.dtype == torch.float32
    expected = torch.tensor([(0 - MEAN) / STD, (1 - MEAN) / STD])
    assert torch.allclose(normalised.flatten(), expected)


def test_missing_files_without_download_name_the_directory(tmp_path):
    data = MNISTDataModule(data_dir=str(tmp_path / "nowhere"), download=False)
    with pytest.raises(ConfigError, match="nowhere/MNIST/raw"):
        data.prepare_data()
    with pytest.raises(ConfigError, match=r"data\.download"):
        data.setup("fit")


def test_failed_download_names_the_directory_and_the_way_out(tmp_path, monkeypatch):
    # A mirror that refuses connections: a real download attempt that fails, with or without network.
    monkeypatch.setattr(MNIST, "mirrors", ["http://127.0.0.1:9/"])
    data = MNISTDataModule(data_dir=str(tmp_path / "offline"), download=True)
    with pytest.raises(ConfigError, match=r"could not download MNIST into .*offline/MNIST/raw.*data\.download: false"):
        data.prepare_data()


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1])
def test_val_fraction_must_leave_both_parts(fraction):
    with pytest.raises(ValueError, match="val_fraction"):
        MNISTDataModule(val_fraction=fraction)


def on_device(data: MNISTDataModule, device: str) -> MNISTDataModule:
    """`data` as a Trainer training on `device` would see it (the meta device stands in for a GPU)."""
    strategy = SimpleNamespace(root_device=torch.device(device))
    data.trainer = SimpleNamespace(strategy=strategy, world_size=1, global_rank=0)
    return data


def test_a_batch_is_cut_whole_with_each_image_beside_its_label():
    images = torch.arange(10, dtype=torch.uint8).view(10, 1, 1, 1).expand(10, 1, 28, 28).contiguous()
    dataset = InMemoryDataset(images, torch.arange(10) * 100)
    loader = DataLoader(dataset, batch_size=4, sampler=[5, 0, 7, 2, 9], collate_fn=already_batched)
    batches = list(loader)
    assert [len(labels) for _, labels in batches] == [4, 1]
    first_images, first_labels = batches[0]
    assert first_images.shape == (4, 1, 28, 28) and first_images.dtype == torch.uint8
    assert first_labels.tolist() == [500, 0, 700, 200]
    assert torch.equal(first_images, images[[5, 0, 7, 2]])


def test_on_device_holds_the_data_where_batches_go(mnist_dir):
    data = on_device(MNISTDataModule(data_dir=str(mnist_dir), download=False, batch_size=16, on_device=True), "meta")
    data.setup("fit")
    assert {tensor.device.type for tensor in (*data.train_set.tensors, *data.val_set.tensors)} == {"meta"}
    loader = data.train_dataloader()
    assert not loader.pin_memory  # pinning is for copies from the CPU, and there are none
    images, labels = next(iter(loader))
    assert images.device.type == labels.device.type == "meta"
    assert images.shape == (16, 1, 28, 28)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_device_batches_on_a_gpu_are_the_ones_from_memory(mnist_dir):
    on_gpu = on_device(MNISTDataModule(data_dir=str(mnist_dir), download=False, on_device=True), "cuda")
    on_gpu.setup("fit")
    in_memory = InMemoryDataset(*(tensor.cpu() for tensor in on_gpu.train_set.tensors))
    indices = [7, 3, 11, 0]
    from_gpu_batch, from_memory_batch = on_gpu.train_set.__getitems__(indices), in_memory.__getitems__(indices)
    for from_gpu, from_memory in zip(from_gpu_batch, from_memory_batch, strict=True):
        assert from_gpu.is_cuda
        assert torch.equal(from_gpu.cpu(), from_memory)


def test_batches_for_a_gpu_come_from_pinned_memory(mnist_dir):
    data = on_device(MNISTDataModule(data_dir=str(mnist_dir), download=False), "cuda")
    data.setup("fit")
    assert data.train_set.tensors[0].device.type == "cpu"
    assert data.train_dataloader().pin_memory


def test_workers_are_kept_between_epochs(mnist_dir):
    data = MNISTDataModule(data_dir=str(mnist_dir), download=False, num_workers=2)
    data.setup("fit")
    assert data.train_dataloader().persistent_workers
    assert not data.train_dataloader().pin_memory  # no GPU here


def test_on_device_refuses_workers():
    with pytest.raises(ValueError, match="num_workers: 0"):
        MNISTDataModule(on_device=True, num_workers=2)


def training_images(mnist_dir: Path) -> torch.Tensor:
    """The training split's images as training sees them (normalised), to compare ids with."""
    data = MNISTDataModule(data_dir=str(mnist_dir), download=False)
    data.setup("fit")
    return data.on_after_batch_transfer(data.train_set.tensors, dataloader_idx=0)[0]


def test_each_process_trains_on_its_own_shard_reshuffled_every_epoch(mnist_dir, two_sharded_processes):
    ranks = [recorded(two_sharded_processes / "seen", rank) for rank in (0, 1)]

    every_image = sorted(sample_ids(training_images(mnist_dir)))
    for epoch in (0, 1):
        first, second = ranks[0][epoch], ranks[1][epoch]
        assert len(first) == len(second) == len(every_image) // 2
        assert sorted(first + second) == every_image  # disjoint shards that cover the training set
    for seen in ranks:
        assert seen[0] != seen[1], "the same order in two epochs: the sampler was not reshuffled"


@pytest.mark.drills
def test_a_mid_epoch_resume_trains_on_exactly_the_rest_of_the_epoch(mnist_dir, tmp_path):
    """MNIST's own loader (whole batches cut from memory, 2 processes x 2 workers) stopped by SIGTERM mid-epoch:
    the same command trains on the same samples in the same order, to the same weights."""

    def args(run: str, *extra: str) -> list[str]:
        record = "--trainer.callbacks+=trainkit.testing.training_samples.RecordTrainingSamples"
        return ["fit", *mnist_run_args(mnist_dir, tmp_path / run), *whole_epochs(2), "--trainer.devices", "2",
                "--data.num_workers", "2", record, "--trainer.callbacks.out_dir", str(tmp_path / run / "samples"),
                *extra]  # fmt: skip

    uninterrupted = run_train(*args("uninterrupted"))
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-4000:]
    marker, log = tmp_path / "step-4", tmp_path / "interrupted.log"
    job = start(args("resumed", *paced(marker, at_step=4)), clean_env(), log)
    wait_for(marker, job, log)
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=60) == 143, log.read_text()[-4000:]
    steps_per_epoch = 576 // 2 // 32  # 640 training files, 10% held out, halved between the processes
    assert load(tmp_path / "resumed" / "checkpoints" / "preempted.ckpt")["global_step"] % steps_per_epoch

    resumed = run_train(*args("resumed"))
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    for rank in (0, 1):
        expected, actual = (recorded(tmp_path / run / "samples", rank) for run in ("uninterrupted", "resumed"))
        assert actual == expected, f"rank {rank} trained on other samples, or in another order, after resuming"
    expected, actual = (load(tmp_path / run / "checkpoints" / "last.ckpt") for run in ("uninterrupted", "resumed"))
    assert actual["global_step"] == expected["global_step"] == 2 * steps_per_epoch
    for name, tensor in expected["state_dict"].items():
        assert torch.equal(tensor, actual["state_dict"][name]), f"{name} differs after resuming"
