"""The example's fixtures: small synthetic MNIST files, and the same converted into chunks."""

import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import EXPERIMENT, PROJECT_ROOT, clean_env, quick_run_args, run_train
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


@pytest.fixture(scope="session")
def two_sharded_processes(mnist_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real run the 2-process tests share: the example sharded on 2 processes (configs/strategy/fsdp.yaml),
    2 whole epochs with its data on the device. In its folder: `run/` (checkpoints), `seen/` (the samples each
    process trained on, each epoch) and `reports/` (what each process held)."""
    folder = tmp_path_factory.mktemp("two-sharded-processes")
    result = run_train(
        "fit", *mnist_run_args(mnist_dir, folder / "run"),
        "--config", str(PROJECT_ROOT / "configs" / "strategy" / "fsdp.yaml"), "--trainer.devices", "2",
        "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "1.0", "--data.on_device", "true",
        "--trainer.callbacks+=trainkit.testing.training_samples.RecordTrainingSamples",
        "--trainer.callbacks.out_dir", str(folder / "seen"),
        "--trainer.callbacks+=trainkit.testing.rank_report.ReportRank",
        "--trainer.callbacks.out_dir", str(folder / "reports"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return folder
