"""The example's fixtures: small synthetic MNIST files, the same converted into chunks, and one 2-process run."""

from pathlib import Path

import pytest
from trainkit.chunks import convert

from {{ cookiecutter.package_name }}.data.mnist import MNISTDataModule

from ..conftest import EXPERIMENT, PROJECT_ROOT, quick_trainer_args, run_train
from .fake_mnist import write_fake_mnist

# The example on top of the experiment, whatever model and data configs/experiment.yaml names now.
THE_EXAMPLE = ("--config", str(EXPERIMENT),
               "--model", str(PROJECT_ROOT / "configs" / "model" / "image_classifier.yaml"),
               "--data", str(PROJECT_ROOT / "configs" / "data" / "mnist.yaml"),
               "--best_checkpoint.monitor", "val/acc", "--best_checkpoint.mode", "max")  # fmt: skip


def mnist_run_args(data_dir: Path, run_dir: Path) -> list[str]:
    """The example for a few steps of 32 images on the small synthetic MNIST, in memory."""
    return [*THE_EXAMPLE, "--data.batch_size", "32", *quick_trainer_args(run_dir),
            "--data.data_dir", str(data_dir), "--data.download", "false"]  # fmt: skip


@pytest.fixture(scope="session")
def mnist_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fake_mnist(tmp_path_factory.mktemp("mnist"))


@pytest.fixture(scope="session")
def mnist_chunks(mnist_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The synthetic MNIST converted into chunks, as the project's chunks command converts it."""
    out = tmp_path_factory.mktemp("chunks") / "mnist-chunks"
    convert(MNISTDataModule(data_dir=str(mnist_dir), download=False), str(out), ["train", "val", "test"], workers=2)
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
