"""One run directory, one job: a second job there is refused, and a lock left by a dead job does not block the next."""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch import Callback, Trainer

from trainkit.run import lock as run_lock
from trainkit.run.errors import ConfigError
from trainkit.testing.runs import training_pid

from .drills import STEPS_PER_EPOCH, TWO_PROCESS_STEPS_PER_EPOCH, full_epochs_args, load, start, wait_for
from .helpers import clean_env, quick_run_args, run_train


class HoldAtStep(Callback):
    """Once step `at_step` is done, rank 0 creates the file `marker`; every process then waits for the file `go`."""

    def __init__(self, marker: str, go: str, at_step: int) -> None:
        self.marker, self.go, self.at_step = Path(marker), Path(go), at_step

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step != self.at_step:
            return
        if trainer.is_global_zero:
            self.marker.touch()
        while not self.go.exists():
            time.sleep(0.2)


def held(marker: Path, go: Path, at_step: int) -> list[str]:
    return [
        f"--trainer.callbacks+={__name__}.HoldAtStep",
        "--trainer.callbacks.marker", str(marker),
        "--trainer.callbacks.go", str(go),
        "--trainer.callbacks.at_step", str(at_step),
    ]  # fmt: skip


@pytest.mark.slow
def test_a_second_job_is_refused_in_one_line_while_evaluation_runs_beside_the_first(experiment, tmp_path):
    run_dir, marker, go, log = tmp_path / "run", tmp_path / "step-2", tmp_path / "go", tmp_path / "first.log"
    args = ["fit", *full_epochs_args(experiment, run_dir), "--trainer.devices", "2"]
    first = start([*args, *held(marker, go, at_step=2)], clean_env(), log)
    try:
        wait_for(marker, first, log)
        holder = training_pid(first)  # the lock is the training process's (run/supervisor.py)
        wandb_runs = sorted((run_dir / "wandb").glob("offline-run-*"))
        # The same command again, as a second job: refused before it builds anything.
        second = run_train(*args)
        assert sorted((run_dir / "wandb").glob("offline-run-*")) == wandb_runs, "the second job started a wandb run"
        # Evaluation takes no lock: it runs beside the training (here on the weights it starts with).
        validated = run_train("validate", *quick_run_args(experiment, run_dir), "--ckpt_path", "null")
        lock = json.loads((run_dir / "run.lock").read_text())
        assert first.poll() is None, "the first job must still be training"
    finally:
        go.touch()
    assert first.wait(timeout=180) == 0, log.read_text()[-4000:]

    assert second.returncode == 2, second.stderr[-4000:]
    assert second.stderr.strip().splitlines()[-1] == (
        f"error: run directory {run_dir} is in use by another job: host {socket.gethostname()}, process {holder},"
        f" started {lock['started']} ({run_dir / 'run.lock'}); stop it, or give this run another"
        " --trainer.default_root_dir"
    )
    assert validated.returncode == 0, validated.stderr[-4000:]
    # Two processes, one lock: the job's first process holds it, and the one Lightning started took none.
    assert lock["pid"] == holder
    assert not (run_dir / "run.lock").exists(), "the lock outlived its job"
    # The first job's work is whole: it trained every step.
    assert load(run_dir / "checkpoints" / "last.ckpt")["global_step"] == 2 * TWO_PROCESS_STEPS_PER_EPOCH


@pytest.mark.slow
def test_a_lock_left_by_a_killed_job_is_taken_over_by_the_same_command(experiment, tmp_path):
    run_dir, marker, go, log = tmp_path / "run", tmp_path / "step", tmp_path / "go", tmp_path / "killed.log"
    args = ["fit", *full_epochs_args(experiment, run_dir)]
    killed = start([*args, *held(marker, go, at_step=STEPS_PER_EPOCH + 2)], clean_env(), log)  # in the second epoch
    wait_for(marker, killed, log)
    holder = training_pid(killed)  # the lock is the training process's (run/supervisor.py)
    os.killpg(killed.pid, signal.SIGKILL)  # the OOM killer, a node failure: nothing runs on exit
    killed.wait(timeout=30)
    assert json.loads((run_dir / "run.lock").read_text())["pid"] == holder

    restarted = run_train(*args)
    output = restarted.stdout + restarted.stderr
    assert restarted.returncode == 0, output[-4000:]
    assert f"taking over the lock of host {socket.gethostname()}, process {holder}," in output
    assert f"process {holder} has ended" in output
    assert "Restoring states from the checkpoint" in output
    assert load(run_dir / "checkpoints" / "last.ckpt")["global_step"] == 2 * STEPS_PER_EPOCH
    assert not (run_dir / "run.lock").exists()


# In this process, as the job's first process: the lock's record as another process wrote it.


@pytest.fixture
def releases(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """What `lock_run_dir` registers to run at exit, kept to be run by the test instead."""
    monkeypatch.setattr(run_lock.rank_zero_only, "rank", 0)
    monkeypatch.delenv("NODE_RANK", raising=False)
    registered: list[tuple] = []
    monkeypatch.setattr(run_lock.atexit, "register", lambda *args: registered.append(args))
    return registered


def write_lock(run_dir: Path, record: dict[str, Any], silent: float = 0) -> None:
    """A lock as its holder wrote it, last touched `silent` seconds ago."""
    (run_dir / "run.lock").write_text(json.dumps(record))
    os.utime(run_dir / "run.lock", (time.time() - silent,) * 2)


def ended_process() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def lock_of(**changes: Any) -> dict[str, Any]:
    """The record of a lock that this test process's parent holds (alive, on this machine), with `changes`."""
    holder = {"pid": os.getppid(), "process_start": run_lock.process_start(os.getppid())}
    return {**run_lock.this_process(), **holder, **changes}


@pytest.mark.parametrize(
    ("changes", "silent"),
    [
        ({}, 600),  # on this machine its process decides, not the heartbeat
        ({"job": "SLURM_JOB_ID=7"}, 0),  # one job may run two trainings on a machine
        ({"machine": "elsewhere", "job": "SLURM_JOB_ID=8"}, 0),
        ({"machine": "elsewhere", "job": None}, 200),
    ],
    ids=["alive-on-this-machine", "same-job-alive-on-this-machine", "another-job-elsewhere", "alive-elsewhere"],
)
def test_a_lock_that_may_still_be_held_is_not_taken_over(tmp_path, releases, monkeypatch, changes, silent):
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    holder = lock_of(**changes)
    assert run_lock.why_abandoned(holder, silent) is None
    write_lock(tmp_path, holder)
    with pytest.raises(ConfigError, match=f"in use by another job: host .*, process {os.getppid()}.*, started"):
        run_lock.lock_run_dir(tmp_path)
    assert json.loads((tmp_path / "run.lock").read_text()) == holder and not releases


@pytest.mark.parametrize(
    ("changes", "silent", "reason"),
    [
        ({"pid": "ended"}, 0, "has ended"),
        ({"process_start": "1"}, 0, "has ended"),  # its process id now belongs to a later process
        ({"machine": "elsewhere", "job": "SLURM_JOB_ID=7"}, 0, "job's own (SLURM_JOB_ID=7), from before a restart"),
        ({"machine": "elsewhere", "job": None}, 600, "no sign of life for 10 min"),
    ],
    ids=["process-ended", "process-id-reused", "same-job-restarted-elsewhere", "no-heartbeat-elsewhere"],
)
def test_an_abandoned_lock_is_taken_over_and_released_at_exit(tmp_path, releases, monkeypatch, changes, silent, reason):
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    if changes.get("pid") == "ended":
        changes["pid"] = ended_process()
    holder = lock_of(**changes)
    assert reason in run_lock.why_abandoned(holder, silent)
    write_lock(tmp_path, holder, silent)

    run_lock.lock_run_dir(tmp_path)
    assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
    (release,) = releases
    release[0](*release[1:])
    assert not (tmp_path / "run.lock").exists()


def test_a_lock_that_cannot_be_read_is_taken_over(tmp_path, releases, caplog):
    (tmp_path / "run.lock").write_text("")  # a job that died as it created it
    with caplog.at_level(logging.INFO):
        run_lock.lock_run_dir(tmp_path)
    assert "taking over the lock of an unknown job: the lock cannot be read" in caplog.text
    assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()


def test_a_run_directory_that_cannot_be_created_is_refused(tmp_path, releases):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"cannot lock run directory .*/file/run: Not a directory"):
        run_lock.lock_run_dir(tmp_path / "file" / "run")


def test_only_the_jobs_first_process_takes_the_lock(tmp_path, releases, monkeypatch):
    monkeypatch.setattr(run_lock.rank_zero_only, "rank", 1)  # a process Lightning, torchrun or Slurm started
    run_lock.lock_run_dir(tmp_path / "a")
    monkeypatch.setattr(run_lock.rank_zero_only, "rank", 0)
    monkeypatch.setenv("NODE_RANK", "1")  # the first process of another node in Lightning's manual launch
    run_lock.lock_run_dir(tmp_path / "b")
    assert not releases and not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_job_identity_is_one_the_platform_keeps_across_restarts(monkeypatch):
    for name in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "SING_JOB_NAME", "JOB_NAME", "POD_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun without --rdzv-id: every job's
    monkeypatch.setenv("JOB_NAME", "nightly")  # a CI system's, outside a pod
    assert run_lock.job_identity() is None
    monkeypatch.setenv("POD_WORLD_SIZE", "2")
    assert run_lock.job_identity() == "JOB_NAME=nightly"
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    assert run_lock.job_identity() == "SLURM_JOB_ID=42"
