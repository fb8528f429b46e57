"""Convert MNIST into litdata chunks for the streaming data path (streaming.py), once:

    python -m {{ cookiecutter.package_name }}.machinery.chunks --data-dir data --out data/mnist-chunks

Reads `<data-dir>/MNIST/raw/` as the in-memory path does, with its train/val split, and writes
`train/`, `val/` and `test/` folders of chunks (files of many samples, each image PNG-encoded as
image datasets are stored). `--out` may also be an object store (`s3://bucket/mnist-chunks`).
Replace `load_splits` and `EncodedSamples` to convert your own data.
"""

import argparse
import os
import sys

import torch
from litdata import optimize
from torch import Tensor
from torchvision.io import encode_png

from ..data.mnist import MNISTDataModule
from .errors import ConfigError
from .exit_codes import CONFIG_ERROR


def load_splits(data_dir: str, val_fraction: float, split_seed: int) -> dict[str, tuple[Tensor, Tensor]]:
    """Images (N, 1, 28, 28) uint8 and labels (N,) of each split, as the in-memory path splits them."""
    data = MNISTDataModule(data_dir=data_dir, download=False, val_fraction=val_fraction, split_seed=split_seed)
    data.setup("fit")
    data.setup("test")
    return {"train": data.train_set.tensors, "val": data.val_set.tensors, "test": data.test_set.tensors}


class EncodedSamples:
    """Sample `i` of a split as it is stored: the PNG bytes of its image and its label."""

    def __init__(self, images: Tensor, labels: Tensor) -> None:
        self.images, self.labels = images, labels

    def __call__(self, index: int) -> dict[str, bytes | int]:
        return {"image": encode_png(self.images[index]).numpy().tobytes(), "label": int(self.labels[index])}


def convert(data_dir: str, out: str, val_fraction: float = 0.1, split_seed: int = 0, chunk_bytes: str = "64MB",
            num_workers: int | None = None) -> None:  # fmt: skip
    for name, (images, labels) in load_splits(data_dir, val_fraction, split_seed).items():
        optimize(
            fn=EncodedSamples(images, labels),
            inputs=list(range(len(labels))),
            output_dir=f"{out.rstrip('/')}/{name}",
            chunk_bytes=chunk_bytes,
            num_workers=num_workers or os.cpu_count() or 1,
            mode="overwrite",
        )


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="data", help="where MNIST/raw/ is (default: data)")
    parser.add_argument("--out", default="data/mnist-chunks", help="a folder or an s3:// or gs:// URL")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="as data.val_fraction (default: 0.1)")
    parser.add_argument("--split-seed", type=int, default=0, help="as data.split_seed (default: 0)")
    parser.add_argument("--chunk-bytes", default="64MB", help="size of each chunk file (default: 64MB)")
    parser.add_argument("--workers", type=int, help="processes that encode (default: one per CPU core)")
    options = parser.parse_args(args)
    torch.set_num_threads(1)  # the work is spread over processes
    try:
        convert(options.data_dir, options.out, options.val_fraction, options.split_seed, options.chunk_bytes,
                options.workers)  # fmt: skip
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(CONFIG_ERROR)


if __name__ == "__main__":
    main()
