"""The machinery tests' experiment: configs/experiment.yaml (its trainer, callbacks, logger and cluster
settings) with the tiny model and data of tiny.py in place of whatever model and data it names.

A copy is written for the test session, so these tests run the same whether configs/experiment.yaml
names the example, a researcher's own model and data, or configs since deleted.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ..conftest import EXPERIMENT, PROJECT_ROOT, clean_env, quick_trainer_args

TINY_MODEL = {"class_path": "tests.machinery.tiny.TinyClassifier", "init_args": {"hidden": 32, "dropout": 0.3,
                                                                                 "lr": 0.01}}  # fmt: skip
TINY_DATA = {"class_path": "tests.machinery.tiny.TinyDataModule", "init_args": {"batch_size": 32}}


def write_tiny_experiment(folder: Path) -> Path:
    """`folder/experiment.yaml`, composing `model/tiny_model.yaml` and `data/tiny_data.yaml` as the real one composes
    its own. (Their names differ: a run's saved config keeps each composed file by its name, in one folder.)"""
    config = yaml.safe_load(EXPERIMENT.read_text())
    for section, tiny in (("model", TINY_MODEL), ("data", TINY_DATA)):
        (folder / section).mkdir(parents=True, exist_ok=True)
        (folder / section / f"tiny_{section}.yaml").write_text(json.dumps(tiny))  # JSON is YAML too
        config[section] = f"{section}/tiny_{section}.yaml"
    (folder / "experiment.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return folder / "experiment.yaml"


@pytest.fixture(scope="session")
def experiment(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_experiment(tmp_path_factory.mktemp("configs"))


@pytest.fixture(scope="session")
def tiny_chunks(experiment: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny data converted into chunks by the project's own command."""
    out = tmp_path_factory.mktemp("chunks") / "tiny-chunks"
    command = [sys.executable, "-m", "trainkit.data.chunks", "--config", str(experiment),
               "--out", str(out), "--workers", "2"]  # fmt: skip
    result = subprocess.run(command, cwd=PROJECT_ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)
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
