"""MNIST as a LightningDataModule.

The digits stay uint8 tensors in memory, as torchvision loads them; there is no per-image
PIL decoding, and a batch is cut from them with one indexing operation (`InMemoryDataset`).
Batches are turned into normalised floats after they reach the device (`on_after_batch_transfer`),
where that work is cheapest. With `on_device: true` the tensors live on the GPU and batches are
cut there, so nothing is copied per step.

Images of your own in class folders need no code: image_folder.py. Data too big for memory
streams from chunks instead (trainkit/chunks.py writes them, streaming_images.py reads them).
"""

import math
from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule
from pydantic import NonNegativeInt, PositiveInt
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset
from torchvision.datasets import MNIST
from trainkit.run.errors import ConfigError

MEAN, STD = 0.1307, 0.3081  # of the MNIST training images, scaled to [0, 1]
RAW_FILES = {
    True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
IMAGE_SIZE = (28, 28)


class InMemoryDataset(TensorDataset):
    """Tensors held whole in memory, on the CPU or a GPU, from which the DataLoader reads whole batches.

    The DataLoader passes all indices of a batch to `__getitems__`: one indexing operation per
    tensor replaces one per sample plus stacking them (on a GPU, a kernel launch per image).
    Samplers work as usual, so Lightning still gives each DDP process its own shard.
    """

    def __getitems__(self, indices: list[int]) -> tuple[Tensor, ...]:
        index = torch.tensor(indices)
        if self.tensors[0].is_cuda:
            # From pinned memory the copy need not wait for the GPU to finish the work queued before it.
            index = index.pin_memory().to(self.tensors[0].device, non_blocking=True)
        return tuple(tensor[index] for tensor in self.tensors)


def normalised(batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """uint8 images as normalised floats, done where the batch is (after it reaches the device)."""
    images, labels = batch
    return images.float().div_(255).sub_(MEAN).div_(STD), labels


def idx_shape(path: Path, dims: int) -> tuple[int, ...]:
    """The shape an IDX file of unsigned bytes (MNIST's format) declares, refused unless the file holds exactly that."""
    header_size = 4 * (1 + dims)
    with path.open("rb") as file:
        header = file.read(header_size)
    magic = 0x0800 + dims  # two zero bytes, 0x08 (unsigned bytes), the number of dimensions
    if len(header) < header_size or int.from_bytes(header[:4], "big") != magic:
        raise ConfigError(f"{path} is not an IDX file of {dims}-dimensional unsigned bytes (no 0x{magic:08x} header)")
    shape = tuple(int.from_bytes(header[start : start + 4], "big") for start in range(4, header_size, 4))
    expected, size = header_size + math.prod(shape), path.stat().st_size
    if size != expected:
        raise ConfigError(
            f"{path} holds {size:,} bytes but its header promises {'x'.join(map(str, shape))} values"
            f" ({expected:,} bytes): the file is truncated or damaged"
        )
    return shape


def already_batched(batch: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """The DataLoader's `collate_fn` for `InMemoryDataset`, whose batches come out whole."""
    return batch


class MNISTDataModule(LightningDataModule):
    """MNIST train/val (a seeded split of the training set) and test (the official test set).

    Args:
        data_dir: where `MNIST/raw/` is, or is downloaded to.
        download: download the files when they are missing (on each node's first process only).
        val_fraction: share of the training set held out for validation.
        batch_size: images per batch on each process.
        num_workers: DataLoader worker processes (0 loads in the training process, the fastest
            for data already in memory). Workers stay alive between epochs.
        split_seed: seed of the train/val split, independent of the training seed.
        on_device: hold the data on the training device (each process's GPU) and cut batches
            there. Each process holds a whole copy (about 50 MB for MNIST); needs `num_workers: 0`.
    """

    # What the model needs to know about the samples (the command line passes them on to it).
    in_channels = 1
    num_classes = 10

    def __init__(
        self,
        data_dir: str = "data",
        download: bool = True,
        val_fraction: float = 0.1,
        batch_size: PositiveInt = 128,
        num_workers: NonNegativeInt = 0,
        split_seed: int = 0,
        on_device: bool = False,
    ):
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction must be between 0 and 1, got {val_fraction}")
        if on_device and num_workers > 0:
            raise ConfigError("data.on_device needs data.num_workers: 0 (workers cannot read GPU memory)")
        self.save_hyperparameters()
        self.data_dir = Path(data_dir)
        self.download = download
        self.val_fraction = val_fraction
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.split_seed = split_seed
        self.on_device = on_device

    @property
    def raw_dir(self) -> Path:
        return self.data_dir / "MNIST" / "raw"

    def prepare_data(self) -> None:
        # Lightning calls this on one process per node, so the download happens once.
        if self.download:
            for train in (True, False):
                self._download(train)
        for train in (True, False):
            self._check_present(train)

    def setup(self, stage: str) -> None:
        if stage in ("fit", "validate"):
            images, labels = self._load_split(train=True)
            order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(self.split_seed))
            num_val = int(len(labels) * self.val_fraction)
            val_ids, train_ids = order[:num_val], order[num_val:]
            self.train_set = self._in_memory(images[train_ids], labels[train_ids])
            self.val_set = self._in_memory(images[val_ids], labels[val_ids])
        if stage in ("test", "predict"):
            self.test_set = self._in_memory(*self._load_split(train=False))

    def train_dataloader(self) -> DataLoader:
        # A new order every epoch; each process gets its own share, resumable mid-epoch (machinery).
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.test_set)

    def on_after_batch_transfer(self, batch: tuple[Tensor, Tensor], dataloader_idx: int) -> tuple[Tensor, Tensor]:
        return normalised(batch)

    def _load_split(self, train: bool) -> tuple[Tensor, Tensor]:
        """Images as uint8 (N, 1, 28, 28) and labels as int64 (N,)."""
        self._check_present(train)
        self._check_contents(train)
        dataset = MNIST(self.data_dir, train=train, download=False)
        return dataset.data.unsqueeze(1), dataset.targets

    def _download(self, train: bool) -> None:
        try:
            MNIST(self.data_dir, train=train, download=True)
        except RuntimeError as error:  # torchvision lists each mirror it tried; the last line is why
            reason = str(error).strip().splitlines()[-1]
            raise ConfigError(
                f"could not download MNIST into {self.raw_dir.resolve()}: {reason}; "
                "without network access, copy the files there and set data.download: false"
            ) from None

    def _check_present(self, train: bool) -> None:
        missing = [name for name in RAW_FILES[train] if not (self.raw_dir / name).is_file()]
        if missing:
            raise ConfigError(
                f"MNIST files {', '.join(missing)} not found in {self.raw_dir.resolve()}; "
                "set data.download: true or point data.data_dir at a directory that has MNIST/raw/"
            )

    def _check_contents(self, train: bool) -> None:
        """Whole files of 28x28 images and as many labels as images, before torchvision reads them."""
        images_file, labels_file = (self.raw_dir / name for name in RAW_FILES[train])
        images, labels = idx_shape(images_file, dims=3), idx_shape(labels_file, dims=1)
        if images[1:] != IMAGE_SIZE:
            raise ConfigError(f"{images_file} holds images of {images[1]}x{images[2]} pixels, expected 28x28")
        if images[0] != labels[0]:
            raise ConfigError(
                f"{self.raw_dir}: {images_file.name} holds {images[0]:,} images but {labels_file.name}"
                f" {labels[0]:,} labels; each image needs one label"
            )

    def _device(self) -> torch.device:
        """Where batches go: this process's device once a Trainer runs this DataModule, else the CPU."""
        return self.trainer.strategy.root_device if self.trainer is not None else torch.device("cpu")

    def _in_memory(self, images: Tensor, labels: Tensor) -> InMemoryDataset:
        if self.on_device:
            images, labels = images.to(self._device()), labels.to(self._device())
        return InMemoryDataset(images, labels)

    def _loader(self, dataset: InMemoryDataset, shuffle: bool = False) -> DataLoader:
        on_cpu = dataset.tensors[0].device.type == "cpu"
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            collate_fn=already_batched,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            # Page-locked batches copy to the GPU faster and without blocking the training process.
            pin_memory=on_cpu and self._device().type == "cuda",
        )
