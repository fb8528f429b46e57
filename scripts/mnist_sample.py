"""Write the shipped real MNIST sample in the layout torchvision.datasets.MNIST reads.

The sample is MNIST's official 10,000-image test split (sample_data/mnist-t10k). It is split
into a training part and a held-out part and written as

    <out>/MNIST/raw/train-images-idx3-ubyte, train-labels-idx1-ubyte   (the first --train images)
    <out>/MNIST/raw/t10k-images-idx3-ubyte,  t10k-labels-idx1-ubyte    (the rest)

so a generated project reads it with its own loading code and `data.download: false`.

    python scripts/mnist_sample.py OUT_DIR [--train 8000]
"""

import argparse
import gzip
import hashlib
import struct
import sys
from pathlib import Path

SAMPLE = Path(__file__).resolve().parent.parent / "sample_data" / "mnist-t10k"
IMAGES, LABELS = "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"


def read_verified(name: str) -> bytes:
    expected = dict(line.split()[::-1] for line in (SAMPLE / "MD5SUMS").read_text().splitlines())
    packed = (SAMPLE / name).read_bytes()
    if hashlib.md5(packed).hexdigest() != expected[name]:
        sys.exit(f"error: {SAMPLE / name} does not match its MD5SUMS entry")
    return gzip.decompress(packed)


def idx_items(data: bytes) -> tuple[list[int], bytes]:
    """The dimensions and the raw items of an IDX file (unsigned bytes)."""
    _, _, _, ndim = struct.unpack(">BBBB", data[:4])  # zero, zero, item type, dimensions
    dims = list(struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim]))
    return dims, data[4 + 4 * ndim :]


def idx_file(dims: list[int], items: bytes) -> bytes:
    return struct.pack(">BBBB", 0, 0, 0x08, len(dims)) + struct.pack(f">{len(dims)}I", *dims) + items


def write_split(out: Path, train: int) -> None:
    image_dims, images = idx_items(read_verified(IMAGES))
    _, labels = idx_items(read_verified(LABELS))
    total, image_size = image_dims[0], image_dims[1] * image_dims[2]
    if not 0 < train < total:
        sys.exit(f"error: --train must be between 1 and {total - 1}, got {train}")
    raw = out / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, start, stop in (("train", 0, train), ("t10k", train, total)):
        count = stop - start
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(
            idx_file([count, *image_dims[1:]], images[start * image_size : stop * image_size])
        )
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(idx_file([count], labels[start:stop]))
    print(f"wrote {train} training and {total - train} held-out real MNIST digits to {raw}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--train", type=int, default=8000)
    args = parser.parse_args()
    write_split(args.out, args.train)
