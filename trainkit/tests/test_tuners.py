"""Lightning's tuners as callbacks: a run with them resumes exactly, without tuning again (checkpoints/tuners.py)."""

from pathlib import Path

import pytest

from trainkit.testing.contract import YourCodeContract

from .helpers import PROJECT_ROOT

pytestmark = pytest.mark.slow

TUNERS = (
    "--trainer.callbacks+=lightning.pytorch.callbacks.LearningRateFinder",
    "--trainer.callbacks.num_training_steps", "5",
    "--trainer.callbacks+=lightning.pytorch.callbacks.BatchSizeFinder",
    "--trainer.callbacks.init_val", "8",  # where the data module's own is 32
    "--trainer.callbacks.max_trials", "1",  # it keeps 8
)  # fmt: skip


class Tuned(YourCodeContract):
    project = PROJECT_ROOT
    run_args = YourCodeContract.args


def test_a_run_tuned_by_lightnings_finders_resumes_exactly_with_what_they_found(tmp_path: Path) -> None:
    """Left in, the finders tune the resumed fit again and load back the state they saved before the checkpoint's
    was loaded: the step count starts over, and the drill's resumed run trains other weights."""
    Tuned().drill(tmp_path, *TUNERS)
    resumed_mid_epoch = (tmp_path / "interrupted.log").read_text()
    assert (
        "resume: BatchSizeFinder, LearningRateFinder tuned this run's first start and do not run again: the learning"
        " rate comes with the optimizer's state; batch_size 8 as found then"
    ) in resumed_mid_epoch
