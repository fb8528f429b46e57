"""Where the kit's tests run training: `project/`, a project of the tests' own (train.py, configs naming the
tiny model and data of trainkit.testing.tiny), with the generic helpers of trainkit.testing.runs bound to it."""

from functools import partial
from pathlib import Path

from trainkit.testing.runs import clean_env, free_port, quick_run_args, quick_trainer_args, run_train, start_train

PROJECT_ROOT = Path(__file__).resolve().parent / "project"
TRAIN_SCRIPT = PROJECT_ROOT / "train.py"
EXPERIMENT = PROJECT_ROOT / "configs" / "experiment.yaml"

run_train = partial(run_train, PROJECT_ROOT)
start = partial(start_train, PROJECT_ROOT)

__all__ = ["EXPERIMENT", "PROJECT_ROOT", "TRAIN_SCRIPT", "clean_env", "free_port", "quick_run_args",
           "quick_trainer_args", "run_train", "start"]  # fmt: skip
