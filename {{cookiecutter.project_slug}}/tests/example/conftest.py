"""The example's fixtures: small synthetic MNIST files, and the same converted into chunks."""

import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import EXPERIMENT, PROJECT_ROOT, clean_env, quick_run_args
from .fake_mnist import write_fake_mnist


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
    command = [sys.executable, "-m", "trainkit.chunks",
               "--config", str(EXPERIMENT), "--data.data_dir", str(mnist_dir),
               "--data.download", "false", "--out", str(out), "--workers", "2"]  # fmt: skip
    result = subprocess.run(command, cwd=PROJECT_ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return out
