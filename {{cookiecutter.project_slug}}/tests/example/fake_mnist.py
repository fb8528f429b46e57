"""Small synthetic MNIST files, in the format torchvision reads (also used by the template's own tests)."""

import struct
from pathlib import Path

import torch


def write_idx(path: Path, data: torch.Tensor) -> None:
    """Write a uint8 tensor as an IDX file, the format MNIST ships in."""
    header = struct.pack(">BBBB", 0, 0, 0x08, data.dim()) + struct.pack(f">{data.dim()}I", *data.shape)
    path.write_bytes(header + data.contiguous().numpy().tobytes())


def fake_digits(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy images whose label is written as a bright row: learnable in a few steps."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (count,), generator=generator)
    images = torch.randint(0, 60, (count, 28, 28), generator=generator, dtype=torch.uint8)
    rows = 4 + 2 * labels
    images[torch.arange(count), rows] = 255
    return images, labels.to(torch.uint8)


def write_fake_mnist(root: Path, train: int = 640, test: int = 160) -> Path:
    """`root/MNIST/raw/` with synthetic train and test files, as torchvision.datasets.MNIST reads them."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, count, seed in (("train", train, 0), ("t10k", test, 1)):
        images, labels = fake_digits(count, seed)
        write_idx(raw / f"{prefix}-images-idx3-ubyte", images)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels)
    return root
