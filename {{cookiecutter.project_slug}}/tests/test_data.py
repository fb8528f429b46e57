import pytest
import torch

from {{ cookiecutter.package_name }}.data import MEAN, STD, MNISTDataModule


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
    with pytest.raises(FileNotFoundError, match="nowhere/MNIST/raw"):
        data.prepare_data()
    with pytest.raises(FileNotFoundError, match=r"data\.download"):
        data.setup("fit")


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1])
def test_val_fraction_must_leave_both_parts(fraction):
    with pytest.raises(ValueError, match="val_fraction"):
        MNISTDataModule(val_fraction=fraction)
