"""The example's fixtures: small synthetic MNIST files, and the same converted into chunks."""

import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ..conftest import EXPERIMENT, PROJECT_ROOT, clean_env, quick_run_args


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


def mnist_run_args(data_dir: Path, run_dir: Path) -> list[str]:
    """The example's experiment for a few steps on the small synthetic MNIST, in memory."""
    return [*quick_run_args(EXPERIMENT, run_dir), "--data.data_dir", str(data_dir), "--data.download", "false"]


@pytest.fixture(scope="session")
def mnist_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fake_mnist(tmp_path_factory.mktemp("mnist"))


@pytest.fixture(scope="session")
def mnist_chunks(mnist_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The synthetic MNIST converted into chunks by the project's own command."""
    out = tmp_path_factory.mktemp("chunks") / "mnist-chunks"
    command = [sys.executable, "-m", "{{ cookiecutter.package_name }}.machinery.chunks",
               "--config", str(EXPERIMENT), "--data.data_dir", str(mnist_dir),
               "--data.download", "false", "--out", str(out), "--workers", "2"]  # fmt: skip
    result = subprocess.run(command, cwd=PROJECT_ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return out
