"""Convert the images of any data module into litdata chunks for the streaming data path, once:

    python -m trainkit.chunks --config configs/experiment.yaml --out data/chunks
    python -m trainkit.chunks --config configs/experiment.yaml \\
        --data configs/data/image_folder.yaml --data.root data/images --out s3://my-bucket/images-chunks

The data module is made from the config as `train.py` makes it (`--data`, `--data.<key>` as there),
and each split is read from the dataset of its loader, sample by sample. The samples must be
(image, label) pairs: a uint8 tensor (channels, height, width) and an integer class. Each split
becomes a folder of chunks, `train/`, `val/` and `test/` (files of many samples, each image
PNG-encoded as image datasets are stored), the training samples in a shuffled order, so that
images sorted by class stream as well as they train from memory. `info/` holds what the
streaming data module needs before it reads a sample: the channels, the number of classes and
the training images' per-channel mean and standard deviation. `--out` may be a folder or an
object store (`s3://...`, `gs://...`).
"""

import io
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from jsonargparse import ArgumentError, Namespace
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningArgumentParser
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor
from torch.utils.data import Dataset
from torchvision.transforms.v2.functional import to_pil_image

from trainkit.cli import ProjectCLI
from trainkit.run.config_errors import OneLineErrorParser, one_line
from trainkit.run.errors import ConfigError
from trainkit.run.exit_codes import CONFIG_ERROR
from trainkit.run.extras import require

STAGES = {"train": "fit", "val": "fit", "test": "test"}  # the stage whose `setup` makes each split


class DataModuleOnly(ProjectCLI):
    """train.py's command line (`--config`, `--data`, `--data.<key>`) and the options below; makes only the data."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        super().add_arguments_to_parser(parser)
        parser.add_argument("--ckpt_path", type=str | None, help="(a training setting; ignored here)")
        parser.add_argument("--out", type=str, required=True, help="a folder or an s3:// or gs:// URL")
        parser.add_argument("--splits", type=list[str], default=list(STAGES), help="the splits to convert")
        parser.add_argument("--shuffle_seed", type=int, default=0, help="seed of the training samples' order")
        parser.add_argument("--chunk_bytes", type=str, default="64MB", help="size of each chunk file")
        parser.add_argument("--workers", type=int | None, help="processes that encode (default: one per CPU core)")

    def before_instantiate_classes(self) -> None:
        pass  # nothing is trained: no run directory, no logger

    def instantiate_classes(self) -> None:
        # Reading the data needs neither the model nor a Trainer.
        parser = LightningArgumentParser()
        parser.add_lightning_class_args(LightningDataModule, "data", subclass_mode=True)
        self.datamodule = parser.instantiate(Namespace(data=self.config.data)).data


def datasets(data: LightningDataModule, splits: list[str]) -> dict[str, Dataset]:
    """The data module's dataset of each split, as training reads them: the datasets of its loaders."""
    unknown = [split for split in splits if split not in STAGES]
    if unknown or "train" not in splits:
        raise ConfigError(f"--splits must hold train and may hold val and test, got {splits}")
    missing = [split for split in splits if not is_overridden(f"{split}_dataloader", data)]
    if missing:
        kept = ",".join(split for split in splits if split not in missing)
        raise ConfigError(f"{type(data).__name__} defines no {missing[0]}_dataloader: convert the splits it has,"
                          f" --splits [{kept}]")  # fmt: skip
    data.prepare_data()
    for stage in dict.fromkeys(STAGES[split] for split in splits):
        data.setup(stage)
    found = {split: getattr(data, f"{split}_dataloader")().dataset for split in splits}
    for split, dataset in found.items():
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise ConfigError(f"{type(data).__name__}: the {split} dataset has no length and indexing to read it by")
        if len(dataset) == 0:
            raise ConfigError(f"{type(data).__name__}: the {split} dataset is empty")
    return found


def described(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"{str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)}"
    if isinstance(value, tuple | list):
        return f"({', '.join(described(item) for item in value)})"
    return type(value).__name__


def image_and_label(sample: Any) -> tuple[Tensor, int] | None:
    """A sample as a uint8 image (channels, height, width) on the CPU and its label, or None if it is not one."""
    if isinstance(sample, tuple | list) and len(sample) == 2:
        image, label = sample
        is_image = isinstance(image, Tensor) and image.dtype == torch.uint8 and image.dim() == 3
        is_tensor_label = isinstance(label, Tensor) and label.numel() == 1 and not label.is_floating_point()
        if is_image and (isinstance(label, int) or is_tensor_label):
            return image.cpu(), int(label)
    return None


def facts(data: LightningDataModule, splits: dict[str, Dataset]) -> dict[str, Any]:
    """Every sample checked, and what the streaming data module needs to know: channels, classes and
    the per-channel mean and standard deviation of the training images (scaled to [0, 1])."""
    channels, labels = None, set()
    total = squares = pixels = 0
    for split, dataset in splits.items():
        for index in range(len(dataset)):
            pair = image_and_label(dataset[index])
            if pair is None:
                raise ConfigError(
                    f"{type(data).__name__}: {split} sample {index} is {described(dataset[index])}; chunks hold"
                    " (image, label) pairs: a uint8 tensor (channels, height, width) and an integer class"
                )
            image, label = pair
            if channels is None:
                channels = image.shape[0]
            if not 1 <= image.shape[0] <= 4:  # what PNG holds: gray, gray + alpha, RGB, RGBA
                raise ConfigError(f"{split} sample {index} has {image.shape[0]} channels; chunks hold images of 1 to 4")
            if image.shape[0] != channels:
                raise ConfigError(f"{split} sample {index} has {image.shape[0]} channels, the first one {channels}")
            if split == "train":
                scaled = image.double().div_(255).flatten(1)
                total, squares = total + scaled.sum(1), squares + scaled.square().sum(1)
                pixels += scaled.shape[1]
                labels.add(label)
    mean = total / pixels
    std = (squares / pixels - mean.square()).sqrt()
    return {
        "in_channels": channels,
        # The data module's count when it has one: the training split need not hold every class.
        "num_classes": getattr(data, "num_classes", max(labels) + 1),
        "mean": mean.tolist(),
        "std": std.tolist(),
    }


class EncodedSamples:
    """Sample `i` of a dataset as it is stored: its image PNG-encoded (lossless) and its label."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __call__(self, index: int) -> dict[str, Any]:
        image, label = image_and_label(self.dataset[index])
        png = io.BytesIO()
        to_pil_image(image).save(png, format="PNG")
        return {"image": png.getvalue(), "label": label}


@contextmanager
def scratch_folders_of_its_own() -> Iterator[None]:
    """litdata's working folders (chunks before they are moved, downloaded inputs) in one temporary folder,
    removed afterwards: by default litdata makes them in the system's temporary folder and leaves them there."""
    folders = {"DATA_OPTIMIZER_CACHE_FOLDER": "chunks", "DATA_OPTIMIZER_DATA_CACHE_FOLDER": "data"}
    if any(variable in os.environ for variable in folders):  # the user chose where they go
        yield
        return
    with tempfile.TemporaryDirectory(prefix="trainkit-chunks-") as scratch:
        os.environ.update({variable: os.path.join(scratch, folder) for variable, folder in folders.items()})
        try:
            yield
        finally:
            for variable in folders:
                del os.environ[variable]


def convert(data: LightningDataModule, out: str, splits: list[str], shuffle_seed: int = 0, chunk_bytes: str = "64MB",
            workers: int | None = None) -> None:  # fmt: skip
    optimize = require("litdata", "converting to chunks").optimize
    out = out.rstrip("/")
    found = datasets(data, splits)
    info = facts(data, found)
    # Forked workers start at once; spawned ones (litdata's default) import torch and the data module's code again.
    options = {"mode": "overwrite", "start_method": "fork" if sys.platform == "linux" else None}
    with scratch_folders_of_its_own():  # forked workers inherit the variables
        for split, dataset in found.items():
            order = list(range(len(dataset)))
            if split == "train":  # a random order: litdata shuffles chunks and samples within a few chunks only
                order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(shuffle_seed)).tolist()
            optimize(EncodedSamples(dataset), order, f"{out}/{split}", chunk_bytes=chunk_bytes, num_workers=workers,
                     **options)  # fmt: skip
        # A dataset of one sample, so that litdata writes (and reads) it wherever the chunks are.
        optimize(json.dumps, [info], f"{out}/info", chunk_size=1, num_workers=1, **options)


def main(args: list[str] | None = None) -> None:
    torch.set_num_threads(1)  # the encoding is spread over processes
    try:
        cli = DataModuleOnly(
            LightningModule,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_callback=None,
            parser_class=OneLineErrorParser,
            parser_kwargs={"description": __doc__.splitlines()[0]},
            run=False,
            args=args,
        )
        options = cli.config
        convert(cli.datamodule, options.out, options.splits, options.shuffle_seed, options.chunk_bytes, options.workers)
    except (ArgumentError, ConfigError) as error:
        print(f"error: {one_line(error)}", file=sys.stderr)
        sys.exit(CONFIG_ERROR)


if __name__ == "__main__":
    main()
