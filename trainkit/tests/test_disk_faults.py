"""The disk the checkpoints go to, failing for real: read-only, too small, filling up mid-run; and a hard kill.

Each drill checks the exit status, the one line the job ends with, and the step the next run of the
same command resumes from. The disks are small tmpfs and read-only mounts, which need root (or
CAP_SYS_ADMIN); without it those drills are skipped. wandb logs outside the full disk: it would
add its own complaints about it, which are not this project's.
"""

import contextlib
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from .drills import (
    TWO_PROCESS_STEPS_PER_EPOCH,
    exit_code,
    full_epochs_args,
    last_words,
    load,
    paced,
    start,
    wait_for,
    with_periodic,
)
from .helpers import clean_env, run_train

pytestmark = pytest.mark.slow


@pytest.fixture
def mount() -> Iterator[Callable[..., None]]:
    """`mount(*arguments)` runs mount(8), or skips the test where this user cannot; unmounted afterwards."""
    mounted: list[str] = []

    def mount_(*arguments: str) -> None:
        result = subprocess.run(["mount", *arguments], capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"this drill mounts a file system, which needs root: {result.stderr.strip()}")
        mounted.append(arguments[-1])

    yield mount_
    for target in reversed(mounted):
        subprocess.run(["umount", "--lazy", target], check=False)


def tmpfs(mount: Callable[..., None], directory: Path, size: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory))


def fill_up(directory: Path) -> Path:
    """Write a file until the disk is full; delete it to make room again."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as out, contextlib.suppress(OSError):
        while True:
            out.write(bytes(2**16))
    return filler


def fit_args(config: Path, run_dir: Path, tmp_path: Path, devices: int = 2, epochs: int = 2) -> list[str]:
    """Whole epochs, every step slowed a little; wandb logs beside the run directory. Each process records its
    batches, and the first creates tmp_path/step-1 once it has trained a step."""
    return ["fit", *full_epochs_args(config, run_dir, epochs), "--trainer.devices", str(devices),
            "--trainer.logger.init_args.save_dir", str(tmp_path / "logs"),
            *paced(tmp_path / "step-1", at_step=1),
            "--trainer.callbacks+=trainkit.testing.training_samples.RecordTrainingSamples",
            "--trainer.callbacks.out_dir", str(tmp_path / "samples")]  # fmt: skip


def batches_trained(tmp_path: Path) -> int:
    """How many batches the first process has trained on so far, over every run of the drill."""
    record = tmp_path / "samples" / "rank0.jsonl"
    return len(record.read_text().splitlines()) if record.exists() else 0


def rerun_resumes(args: list[str], checkpoint: Path, tmp_path: Path, epochs: int = 2) -> None:
    """The same command again (on two processes): it resumes from `checkpoint`, trains only the steps after it,
    and finishes."""
    total_steps = epochs * TWO_PROCESS_STEPS_PER_EPOCH
    resumed_at, trained_before = load(checkpoint)["global_step"], batches_trained(tmp_path)
    result = run_train(*args)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert f"Restored all states from the checkpoint at {checkpoint}" in output, output[-4000:]
    assert batches_trained(tmp_path) - trained_before == total_steps - resumed_at
    assert load(checkpoint.with_name("last.ckpt"))["global_step"] == total_steps


def test_a_read_only_checkpoint_directory_is_refused_before_training(experiment, mount, tmp_path):
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "wandb-run-id").write_text("0123abcd")  # as an earlier run leaves it
    mount("--bind", str(checkpoints), str(checkpoints))
    mount("-o", "remount,bind,ro", str(checkpoints))

    result = run_train(*fit_args(experiment, tmp_path / "run", tmp_path, devices=1))
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2, result.stderr[-4000:]
    assert errors == [result.stderr.strip().splitlines()[-1]] and len(errors) == 1, result.stderr[-4000:]
    assert errors[0].startswith(f"error: checkpoint directory {checkpoints} is not writable (Read-only file system)")
    assert not (tmp_path / "step-1").exists(), "it trained before refusing"


def test_a_disk_too_small_for_a_checkpoint_is_refused_before_training(experiment, mount, tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    tmpfs(mount, run_dir, "16k")  # room for the run's small files, not for a checkpoint

    job = start(fit_args(experiment, run_dir, tmp_path), clean_env(), log)
    code = exit_code(job, timeout=120, hang="the job hung instead of refusing")
    output = log.read_text()
    assert code == 2, output[-4000:]
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0] == last_words(log), output[-4000:]
    assert errors[0].startswith(f"error: checkpoint directory {run_dir / 'checkpoints'} has only "), errors
    assert "free, a checkpoint needs about" in errors[0]
    assert not (tmp_path / "step-1").exists(), "it trained before refusing"


def test_a_disk_that_fills_up_ends_in_one_line_and_keeps_the_previous_checkpoint(experiment, mount, tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    checkpoints = run_dir / "checkpoints"
    tmpfs(mount, run_dir, "2m")
    args = fit_args(with_periodic(experiment, every_n_steps=3), run_dir, tmp_path)
    job = start(args, clean_env(), log)
    wait_for(checkpoints / "periodic.ckpt", job, log)
    filler = fill_up(run_dir)

    code = exit_code(job, timeout=60, hang="the job hung after a failed write")
    output = log.read_text()
    assert code == 74, output[-4000:]  # exit_codes.CANNOT_WRITE
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0] == last_words(log), output[-4000:]
    assert errors[0].startswith(f"error: could not write checkpoint {checkpoints}/"), errors
    assert ": No space left on device; the checkpoints written before it are intact" in errors[0]
    assert "Traceback" not in output
    assert not [path for path in checkpoints.iterdir() if path.name.startswith(".")], "temporary files left"

    filler.unlink()  # the disk fixed: the newest checkpoint (periodic.ckpt at step 3, unless slow) resumes
    newest = max(checkpoints.glob("*.ckpt"), key=lambda path: path.stat().st_mtime)
    rerun_resumes(args, newest, tmp_path)


def test_sigterm_on_a_full_disk_exits_143_saying_the_checkpoint_was_not_written(experiment, mount, tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    checkpoints = run_dir / "checkpoints"
    tmpfs(mount, run_dir, "2m")
    args = fit_args(experiment, run_dir, tmp_path)
    job = start(args, clean_env(), log)
    wait_for(checkpoints / "last.ckpt", job, log)  # the first epoch's end
    filler = fill_up(run_dir)
    job.send_signal(signal.SIGTERM)

    code = exit_code(job, timeout=60, hang="the job hung after its preemption checkpoint failed")
    output = log.read_text()
    assert code == 143, output[-4000:]
    said = [line for line in output.splitlines() if line.startswith("SIGTERM:")]
    assert len(said) == 1 and said[0] == last_words(log), output[-4000:]
    assert said[0].startswith(f"SIGTERM: could not save {checkpoints / 'preempted.ckpt'} at step "), said
    assert said[0].endswith(
        f" (No space left on device); the job will resume from {checkpoints / 'last.ckpt'}; exiting (143)"
    ), said
    assert "Traceback" not in output and "error:" not in output
    assert not (checkpoints / "preempted.ckpt").exists()

    filler.unlink()
    rerun_resumes(args, checkpoints / "last.ckpt", tmp_path)


def test_sigkill_mid_epoch_loses_only_the_steps_since_the_periodic_checkpoint(experiment, tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    periodic = run_dir / "checkpoints" / "periodic.ckpt"
    # Every 0.6 s of training: the processes compare clocks after 10 batches (2 s here, every step
    # slowed to 0.2 s), and save after 20, in the third epoch; the run trains 36.
    args = fit_args(with_periodic(experiment, every_minutes=0.01), run_dir, tmp_path, epochs=4)
    job = start(args, clean_env(), log)
    wait_for(periodic, job, log)
    os.killpg(job.pid, signal.SIGKILL)  # the whole job at once: nothing can save
    assert job.wait(timeout=30) == -signal.SIGKILL

    assert load(periodic)["global_step"] == 20, "saved when the processes agreed the time was up"
    rerun_resumes(args, periodic, tmp_path, epochs=4)
