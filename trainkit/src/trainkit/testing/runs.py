"""Run a project's `train.py` for real, as a user or a platform runs it, and read what the run left behind."""

import os
import random
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from trainkit.run.exit_codes import LOST_NODE
from trainkit.run.worker_start import FORK_BUG, NOT_STARTED, fork_can_hang

# Variables a cluster sets: a test starts from an environment without any, then sets the ones it means.
CLUSTER_PREFIXES = ("SING_", "SLURM_", "TORCHELASTIC_", "POD_", "PL_")
CLUSTER_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "JOB_NAME", "SVC_NAME", "POD_NAMESPACE"}  # fmt: skip


PORTS_FROM = 10000  # clear of the ports services commonly listen on
EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port() -> int:
    """A port free now, below the range the system takes its outgoing connections' ports from.

    A port of that range (what binding port 0 returns) may be taken by any connection opened before the
    run listens on it: the run's main node would find it taken.
    """
    below = first_ephemeral_port()
    # Where the system hands out nearly every port, none is safe from it: any free one will do.
    ports = range(PORTS_FROM, below) if below - PORTS_FROM >= 1000 else range(1024, 65536)
    for port in random.SystemRandom().sample(ports, 100):  # drawn apart from the other tests running at once
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port among 100 drawn from {ports.start}-{ports.stop - 1} on this host")


def first_ephemeral_port() -> int:
    """Where Linux's range of ports for outgoing connections begins (elsewhere: Linux's default)."""
    try:
        return int(EPHEMERAL_PORTS.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def clean_env(**variables: str) -> dict[str, str]:
    """This process's environment without any cluster variables, wandb offline, plus `variables`."""
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in CLUSTER_NAMES and not name.startswith(CLUSTER_PREFIXES)
    }
    env.update({"WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1", **variables})
    return env


def quick_trainer_args(run_dir: Path) -> list[str]:
    """A few steps on the CPU, the run's files in `run_dir`."""
    return [
        "--trainer.accelerator", "cpu",
        "--trainer.max_epochs", "1",
        "--trainer.limit_train_batches", "4",
        "--trainer.limit_val_batches", "2",
        "--trainer.default_root_dir", str(run_dir),
        "--trainer.enable_progress_bar", "false",
    ]  # fmt: skip


def quick_run_args(config: Path, run_dir: Path) -> list[str]:
    """`fit` with the experiment `config` for a few steps of 32 samples, on the CPU."""
    return ["--config", str(config), "--data.batch_size", "32", *quick_trainer_args(run_dir)]


def whole_epochs(epochs: int = 2) -> list[str]:
    """Whole epochs (not a few batches), so that an interruption can land mid-epoch."""
    return ["--trainer.max_epochs", str(epochs), "--trainer.limit_train_batches", "1.0"]


def paced(marker: Path, at_step: int) -> list[str]:
    """0.2 s a step, and the file `marker` once step `at_step` is done (pacing.PaceSteps)."""
    return [
        "--trainer.callbacks+=trainkit.testing.pacing.PaceSteps",
        "--trainer.callbacks.marker", str(marker),
        "--trainer.callbacks.at_step", str(at_step),
    ]  # fmt: skip


def signal_at(step: int) -> list[str]:
    """Every process sends itself SIGTERM once step `step` is done (pacing.SignalAtStep): a stop on that very step."""
    return ["--trainer.callbacks+=trainkit.testing.pacing.SignalAtStep", "--trainer.callbacks.at_step", str(step)]


def run_train(project: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 300):
    """`python train.py ARGS` from the project's root, to its end: a CompletedProcess with its output.

    On a Python whose own fork can hang the child (run/worker_start.py), a job that ended with 75 because a data
    loader worker never started runs once more, as the platform it asks to retry it would, with a warning."""

    def run() -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(project / "train.py"), *args],
            cwd=project,
            env=env or clean_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    result = run()
    if ended_for_a_stuck_fork(result):
        warnings.warn(f"a data loader worker hung in its fork ({FORK_BUG}): the job ran again", stacklevel=2)
        result = run()
    return result


def ended_for_a_stuck_fork(result: subprocess.CompletedProcess) -> bool:
    """Whether a run ended with 75 because a loader worker never started, on a Python whose fork can hang it."""
    return result.returncode == LOST_NODE and fork_can_hang() and NOT_STARTED in result.stderr


def start_train(project: Path, args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """`train.py` started as a platform starts a node: its own process group, output to a log file."""
    with log.open("w") as output:  # the process writes its own copy
        return subprocess.Popen(
            [sys.executable, str(project / "train.py"), *args],
            cwd=project,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def wait_for(path: Path, process: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    """Return once `path` exists; a test failure if the process ends first or `timeout` passes."""
    __tracebackhide__ = True  # a failure shows the test's line and its message, not this code
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, f"exited with {process.returncode}:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"{path.name} did not appear:\n{log.read_text()[-4000:]}"
        time.sleep(0.2)


def training_pid(process: subprocess.Popen, timeout: float = 30) -> int:
    """The process that trains under `train.py` as started (run/supervisor.py): the one child it runs and waits for."""
    deadline = time.monotonic() + timeout
    while True:
        children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
        if children:
            return int(children[0])
        assert time.monotonic() < deadline, f"process {process.pid} started no training process"
        time.sleep(0.1)


def exit_code(process: subprocess.Popen, timeout: float, hang: str) -> int:
    """The process's exit status; a test failure (after killing its whole group) if it runs past `timeout`."""
    __tracebackhide__ = True  # a failure shows the test's line and its message, not this code
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(hang)


def load(path: Path) -> dict:
    """A checkpoint, as resuming loads it."""
    return torch.load(path, weights_only=True, map_location="cpu")
