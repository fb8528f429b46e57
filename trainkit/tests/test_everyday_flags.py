"""The one-flag changes people make every day train on the default config, for a few steps each."""

import pytest

from .helpers import quick_run_args, run_train

pytestmark = pytest.mark.slow

LOGGER_OFF = "trainer.logger is off: leaving out LearningRateMonitor"
CHECKPOINTING_OFF = (
    "trainer.enable_checkpointing is false: leaving out BestCheckpoint, LastCheckpoint, PreemptionCheckpoint,"
    " PeriodicCheckpoint; starting afresh instead of resuming (ckpt_path: last)"
)

EVERYDAY_FLAGS = {
    "no logger": ["--trainer.logger", "false"],
    "no checkpointing": ["--trainer.enable_checkpointing", "false"],
    "no validation": ["--trainer.limit_val_batches", "0"],
    "no sanity check": ["--trainer.num_sanity_val_steps", "0"],
    "two processes": ["--trainer.devices", "2"],
    "fast dev run": ["--trainer.fast_dev_run", "true"],
    "validation every 2 steps": ["--trainer.val_check_interval", "2"],
    "bf16 mixed precision": ["--trainer.precision", "bf16-mixed"],
    "gradient accumulation": ["--trainer.accumulate_grad_batches", "2"],
    "profiler": ["--trainer.profiler", "simple"],
    "no progress bar": ["--trainer.enable_progress_bar", "false"],
    "a progress bar of one's own": ["--trainer.callbacks+=TQDMProgressBar", "--trainer.callbacks.refresh_rate", "10"],
    "data loader workers": ["--data.num_workers", "2"],
    "overfit a few batches": ["--trainer.overfit_batches", "2"],
    "no resume": ["--ckpt_path", "null"],
    # save_dir "." stands for trainer.default_root_dir, as in configs/loggers/.
    "CSV logger on the command line": ["--trainer.logger", "CSVLogger", "--trainer.logger.save_dir", "."],
}


def everyday_args(experiment, run_dir) -> list[str]:
    """The quick CPU run, with the progress output left to the project, as a user leaves it."""
    args = quick_run_args(experiment, run_dir)
    at = args.index("--trainer.enable_progress_bar")
    return args[:at] + args[at + 2 :]


@pytest.mark.parametrize("flag", EVERYDAY_FLAGS.values(), ids=EVERYDAY_FLAGS.keys())
def test_everyday_flag_trains_on_the_default_config(experiment, tmp_path, flag):
    run_dir = tmp_path / "run"
    result = run_train("fit", *everyday_args(experiment, run_dir), *flag)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "Traceback" not in output
    assert "`Trainer.fit` stopped" in output  # it trained to the end
    assert output.count(LOGGER_OFF) == (flag == EVERYDAY_FLAGS["no logger"])
    assert output.count(CHECKPOINTING_OFF) == (flag == EVERYDAY_FLAGS["no checkpointing"])
    if flag == EVERYDAY_FLAGS["no checkpointing"]:
        assert not list(run_dir.rglob("*.ckpt"))
    if flag == EVERYDAY_FLAGS["CSV logger on the command line"]:
        assert list(run_dir.rglob("metrics.csv"))


def test_a_rerun_told_not_to_resume_starts_afresh(experiment, tmp_path):
    # With checkpointing off or `--ckpt_path null`, a rerun ignores the checkpoints an earlier run left.
    args = ["fit", *quick_run_args(experiment, tmp_path / "run")]
    first = run_train(*args, "--ckpt_path", "null")  # in a new run directory: its checkpoints/ holds no checkpoint
    assert first.returncode == 0 and "exists and is not empty" not in first.stderr, first.stderr[-3000:]
    for flag in (["--trainer.enable_checkpointing", "false"], ["--ckpt_path", "null"]):
        rerun = run_train(*args, *flag)
        output = rerun.stdout + rerun.stderr
        assert rerun.returncode == 0, output[-4000:]
        assert output.count(CHECKPOINTING_OFF) == (flag[0] == "--trainer.enable_checkpointing")  # said once
        assert "Restoring states" not in output and "resume:" not in output, flag
