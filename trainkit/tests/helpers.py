"""Where the kit's tests run training: `project/`, a project of the tests' own (train.py, configs naming the
tiny model and data of trainkit.testing.tiny), with the generic helpers of trainkit.testing.runs bound to it."""

import subprocess
import sys
from functools import partial
from pathlib import Path

from trainkit.testing.runs import clean_env, free_port, quick_run_args, quick_trainer_args, run_train, start_train

PROJECT_ROOT = Path(__file__).resolve().parent / "project"
TRAIN_SCRIPT = PROJECT_ROOT / "train.py"
EXPERIMENT = PROJECT_ROOT / "configs" / "experiment.yaml"

run_train = partial(run_train, PROJECT_ROOT)
start = partial(start_train, PROJECT_ROOT)


def run_chunks(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m trainkit.chunks ARGS` from the project's root, to its end: a CompletedProcess with its output."""
    command = [sys.executable, "-m", "trainkit.chunks", *args]
    return subprocess.run(
        command, cwd=PROJECT_ROOT, env=env or clean_env(), capture_output=True, text=True, timeout=300
    )


__all__ = ["EXPERIMENT", "PROJECT_ROOT", "TRAIN_SCRIPT", "clean_env", "free_port", "quick_run_args",
           "quick_trainer_args", "run_chunks", "run_train", "start"]  # fmt: skip
