"""Shared test helpers: small synthetic MNIST files and a way to run `train.py` for real."""

import os
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

PROJECT_ROOT = Path(__file__).resolve().parent.parent
TRAIN_SCRIPT = PROJECT_ROOT / "train.py"


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


@pytest.fixture(scope="session")
def mnist_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fake_mnist(tmp_path_factory.mktemp("mnist"))


@pytest.fixture(scope="session")
def mnist_chunks(mnist_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The synthetic MNIST converted into chunks by the project's own command."""
    out = tmp_path_factory.mktemp("chunks") / "mnist-chunks"
    command = [sys.executable, "-m", "{{ cookiecutter.package_name }}.machinery.chunks",
               "--config", str(PROJECT_ROOT / "configs" / "experiment.yaml"), "--data.data_dir", str(mnist_dir),
               "--data.download", "false", "--out", str(out), "--workers", "2"]  # fmt: skip
    result = subprocess.run(command, cwd=PROJECT_ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def quick_run_args(data_dir: Path, run_dir: Path) -> list[str]:
    """`fit` on the small synthetic data in memory for a few steps, on CPU, with no logger service."""
    return [
        "--config", str(PROJECT_ROOT / "configs" / "experiment.yaml"),
        "--data.data_dir", str(data_dir),
        "--data.download", "false",
        "--data.batch_size", "32",
        *quick_trainer_args(run_dir),
    ]  # fmt: skip


def streaming_run_args(chunks_dir: Path, run_dir: Path) -> list[str]:
    """The same, streamed from chunks: 16 images a batch, so 2 processes x 2 workers share them evenly."""
    return [
        "--config", str(PROJECT_ROOT / "configs" / "experiment.yaml"),
        "--data", str(PROJECT_ROOT / "configs" / "data" / "streaming_images.yaml"),
        "--data.input_dir", str(chunks_dir),
        "--data.batch_size", "16",
        *quick_trainer_args(run_dir),
    ]  # fmt: skip


def quick_trainer_args(run_dir: Path) -> list[str]:
    return [
        "--trainer.accelerator", "cpu",
        "--trainer.max_epochs", "1",
        "--trainer.limit_train_batches", "4",
        "--trainer.limit_val_batches", "2",
        "--trainer.default_root_dir", str(run_dir),
        "--trainer.enable_progress_bar", "false",
    ]  # fmt: skip


def clean_env(**variables: str) -> dict[str, str]:
    """This process's environment without any cluster variables, plus `variables`."""
    cluster_prefixes = ("SING_", "SLURM_", "TORCHELASTIC_", "POD_", "PL_")
    cluster_names = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                     "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "JOB_NAME", "SVC_NAME", "POD_NAMESPACE"}  # fmt: skip
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in cluster_names and not name.startswith(cluster_prefixes)
    }
    env.update(WANDB_MODE="offline", PYTHONUNBUFFERED="1", **variables)
    return env


def run_train(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `python train.py ARGS` as a user would, from the project root."""
    return subprocess.run(
        [sys.executable, str(TRAIN_SCRIPT), *args],
        cwd=PROJECT_ROOT,
        env=env or clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
