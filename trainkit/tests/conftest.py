"""The kit's tests: they run `project/train.py` with the tests' tiny model and data (trainkit.testing.tiny).

Every process a test starts imports the kit from `src/` and the tests' helpers from here, installed or not.
"""

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from .helpers import EXPERIMENT, PROJECT_ROOT, quick_trainer_args, run_chunks

KIT_ROOT = Path(__file__).resolve().parent.parent
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(KIT_ROOT / "src"), str(KIT_ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
)


@pytest.fixture(scope="session", autouse=True)
def temporary_files_of_this_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every temporary file of the tests and of the runs they start goes to one folder, removed at the end.

    Left in the system's: torchrun's log folder (never deleted), and the temporary files and sockets of the
    processes a drill kills or ends with `os._exit` (wandb's, multiprocessing's). A short path, because wandb's
    sockets live there.
    """
    tmp_path_factory.getbasetemp()  # pytest's own folder stays in the system's, kept for a look after a failure
    folder = tempfile.mkdtemp(prefix="trainkit-tests-")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", folder)
        patch.setattr(tempfile, "tempdir", folder)
        yield
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def experiment(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """project/configs/experiment.yaml (trainkit's defaults with the tiny model and data), in a copy of the
    configs for the session: tests write variants of it beside it, where its relative paths hold."""
    configs = tmp_path_factory.mktemp("project") / "configs"
    shutil.copytree(EXPERIMENT.parent, configs)
    return configs / EXPERIMENT.name


@pytest.fixture(scope="session")
def tiny_chunks(experiment: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny data converted into chunks by the project's own command."""
    out = tmp_path_factory.mktemp("chunks") / "tiny-chunks"
    result = run_chunks("--config", str(experiment), "--out", str(out), "--workers", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def streaming_run_args(experiment: Path, chunks_dir: Path, run_dir: Path) -> list[str]:
    """A few steps streamed from chunks: 16 images a batch, so 2 processes x 2 workers share them evenly."""
    return [
        "--config", str(experiment),
        "--data", str(PROJECT_ROOT / "configs" / "data" / "streaming_images.yaml"),
        "--data.input_dir", str(chunks_dir),
        "--data.batch_size", "16",
        *quick_trainer_args(run_dir),
    ]  # fmt: skip
