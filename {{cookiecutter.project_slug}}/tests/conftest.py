"""Where this project's tests run training: its own `train.py` and configs, with trainkit.testing's helpers.

The kit's guarantees are tested where the kit is developed; these tests are about this project's code.
"""

from functools import partial
from pathlib import Path

from trainkit.testing.runs import clean_env, free_port, quick_run_args, quick_trainer_args, run_train, start_train

PROJECT_ROOT = Path(__file__).resolve().parent.parent
TRAIN_SCRIPT = PROJECT_ROOT / "train.py"
EXPERIMENT = PROJECT_ROOT / "configs" / "experiment.yaml"

run_train = partial(run_train, PROJECT_ROOT)
start = partial(start_train, PROJECT_ROOT)

__all__ = ["EXPERIMENT", "PROJECT_ROOT", "TRAIN_SCRIPT", "clean_env", "free_port", "quick_run_args",
           "quick_trainer_args", "run_train", "start"]  # fmt: skip
