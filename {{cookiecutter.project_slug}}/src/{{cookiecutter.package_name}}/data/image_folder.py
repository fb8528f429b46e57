"""Your own images, one folder per class, held in memory: the data module to start from for your data.

    root/train/<class>/*.png|jpg     the training images, one sub-folder per class
    root/val/<class>/*.png|jpg       the validation images, the same class folders
    root/test/<class>/*.png|jpg      optional: the held-out images (`train.py test`)

Every image is decoded once, in `setup`, into one uint8 tensor per split; batches become
normalised floats after they reach the device, with the per-channel mean and standard deviation
of the training images. More images than memory holds: convert them to chunks once and stream
them (trainkit/chunks.py, trainkit/data/streaming.py).
"""

from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule
from PIL import Image
from pydantic import NonNegativeInt, PositiveInt
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset
from torchvision.transforms.v2.functional import pil_to_tensor
from trainkit.run.errors import ConfigError

SPLITS = ("train", "val", "test")
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg"}
MODES = {1: "L", 2: "LA", 3: "RGB", 4: "RGBA"}  # each channel count's image mode: gray, gray + alpha, RGB, RGBA


def decoded(path: Path) -> Image.Image:
    """An image file decoded. An image with a palette gets the channels of its colours (RGB or RGBA)."""
    try:
        with Image.open(path) as file:
            return file.convert()
    except (OSError, Image.DecompressionBombError) as error:  # truncated, not an image, or too large
        raise ConfigError(f"{path} cannot be read as an image: {error}") from None


def channel_statistics(images: Tensor) -> tuple[Tensor, Tensor]:
    """Per-channel mean and standard deviation of uint8 images (N, C, H, W), scaled to [0, 1]."""
    total = torch.zeros(images.shape[1], dtype=torch.float64)
    squares = torch.zeros_like(total)
    for batch in images.split(1024):  # a float copy of a batch at a time, not of the whole split
        pixels = batch.double().div_(255).transpose(0, 1).flatten(1)
        total += pixels.sum(1)
        squares += pixels.square().sum(1)
    count = images.numel() / images.shape[1]
    mean = total / count
    return mean.float(), (squares / count - mean.square()).sqrt().float()


class ImageFolderDataModule(LightningDataModule):
    """Images in class folders: train, val and (optionally) test, each decoded into memory.

    Args:
        root: the folder holding `train/`, `val/` and optionally `test/`.
        image_size: [height, width] every image is resized to; without it all images must have one size.
        channels: 1 (gray), 2 (gray + alpha), 3 (RGB) or 4 (RGBA), each image converted to it;
            by default as many as the first training image has (an image with more is refused: its
            colours would be dropped).
        batch_size: images per batch on each process.
        num_workers: DataLoader worker processes (0 reads in the training process: the data is in memory).
    """

    def __init__(
        self,
        root: str = "data/images",
        image_size: tuple[PositiveInt, PositiveInt] | None = None,
        channels: PositiveInt | None = None,
        batch_size: PositiveInt = 128,
        num_workers: NonNegativeInt = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.root = Path(root)
        self.image_size = image_size
        self.batch_size = batch_size
        self.num_workers = num_workers
        # What the model needs to know, found before setup: the command line passes it on to the model.
        self.classes = self._class_names()
        self.num_classes = len(self.classes)
        self.channels_given = channels is not None
        self.first_image = self._image_files("train")[0][0]
        self.in_channels = channels or len(decoded(self.first_image).getbands())
        if self.in_channels not in MODES:
            raise ConfigError(f"data.channels must be 1, 2, 3 or 4, got {self.in_channels}")

    def setup(self, stage: str) -> None:
        if not hasattr(self, "train_set"):  # every split is normalised with the training images' statistics
            self.train_set = self._load("train")
            self.mean, self.std = channel_statistics(self.train_set.tensors[0])
        if stage in ("fit", "validate"):
            self.val_set = self._load("val")
        if stage in ("test", "predict"):
            self.test_set = self._load("test")

    def train_dataloader(self) -> DataLoader:
        # An ordinary shuffling loader: the machinery shares it out over processes and resumes it mid-epoch.
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.test_set)

    def on_after_batch_transfer(self, batch: tuple[Tensor, Tensor], dataloader_idx: int) -> tuple[Tensor, Tensor]:
        images, labels = batch
        if self.mean.device != images.device:  # moved once: a copy from CPU memory at every batch waits for the GPU
            self.mean, self.std = self.mean.to(images.device), self.std.to(images.device)
        mean, std = self.mean.view(1, -1, 1, 1), self.std.view(1, -1, 1, 1)
        return images.float().div_(255).sub_(mean).div_(std), labels

    def _class_names(self) -> list[str]:
        """The class folders' names, in sorted order (a class's label is its place in it), the same in every split."""
        if not self.root.is_dir():
            raise ConfigError(f"image folder {self.root.resolve()} does not exist (data.root)")
        classes = {}
        for split in SPLITS:
            folder = self.root / split
            if folder.is_dir():
                # Not a hidden folder (.ipynb_checkpoints, a sync tool's): no class of the researcher's.
                classes[split] = sorted(path.name for path in folder.iterdir() if path.is_dir() and path.name[0] != ".")
            elif split != "test":
                raise ConfigError(f"image folder {self.root.resolve()} has no {split}/ folder")
        if not classes["train"]:
            raise ConfigError(f"{(self.root / 'train').resolve()} has no class folders (train/<class>/<image>.png)")
        for split, names in classes.items():
            if names != classes["train"]:
                missing, extra = set(classes["train"]) - set(names), set(names) - set(classes["train"])
                raise ConfigError(
                    f"{(self.root / split).resolve()} has other class folders than train/:"
                    f" missing {sorted(missing) or 'none'}, extra {sorted(extra) or 'none'}"
                )
        return classes["train"]

    def _image_files(self, split: str) -> list[tuple[Path, int]]:
        """Each image file of a split with its label, in a fixed order."""
        folder = self.root / split
        if not folder.is_dir():
            raise ConfigError(f"image folder {self.root.resolve()} has no {split}/ folder")
        files = [
            (path, label)
            for label, name in enumerate(self.classes)
            for path in sorted((folder / name).iterdir())
            if path.suffix.lower() in IMAGE_SUFFIXES
        ]
        if not files:
            raise ConfigError(f"{folder.resolve()} holds no .png or .jpg images in its class folders")
        empty = [name for label, name in enumerate(self.classes) if all(file[1] != label for file in files)]
        if split == "train" and empty:  # a class the model would be built for and never see
            raise ConfigError(
                f"{(folder / empty[0]).resolve()} holds no .png or .jpg images: add some, or remove the class folder"
                " from every split"
            )
        return files

    def _load(self, split: str) -> TensorDataset:
        """A split's images as one uint8 tensor (N, C, H, W) and its labels as int64 (N,)."""
        files = self._image_files(split)
        images = []
        for path, _ in files:
            image = decoded(path)
            if len(image.getbands()) > self.in_channels and not self.channels_given:  # its colours would be lost
                raise ConfigError(
                    f"{path} has {len(image.getbands())} channels, {self.first_image} (the first training image, which"
                    f" sets the count) {self.in_channels}: set data.channels to the count to convert every image to"
                )
            image = image.convert(MODES[self.in_channels])
            if self.image_size is not None:
                height, width = self.image_size
                image = image.resize((width, height), Image.Resampling.BILINEAR)
            image = pil_to_tensor(image)
            if images and image.shape[1:] != images[0].shape[1:]:
                raise ConfigError(
                    f"{path} is {image.shape[2]}x{image.shape[1]} pixels, {files[0][0]} is"
                    f" {images[0].shape[2]}x{images[0].shape[1]}; set data.image_size to resize them to one size"
                )
            images.append(image)
        labels = torch.tensor([label for _, label in files])
        return TensorDataset(torch.stack(images), labels)

    def _loader(self, dataset: TensorDataset, shuffle: bool = False) -> DataLoader:
        on_gpu = self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=on_gpu,  # page-locked batches copy to the GPU faster
        )
