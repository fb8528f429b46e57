"""The failure battery, signals: SIGTERM and SIGINT at every moment of a real run end it as promised.

Each case runs the default generated project on the real digits, on CPU, started the way a platform
starts a node (its own process group), and signals it the way platforms and people do: SIGTERM to
the first process only (Kubernetes, Docker), to every process of the group (Slurm, `kill -TERM
-<pgid>`), SIGINT to the group (Ctrl-C in a terminal). Promised: exit 143 after SIGTERM and 130
after SIGINT, within seconds at any moment, a checkpoint once training has started, and no process
of the job left behind.
"""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from .host import root_or_skip
from .launch_runs import launch_environment

PREEMPTED, INTERRUPTED = 143, 130
PACED = "--trainer.callbacks+=trainkit.testing.pacing.PaceSteps"  # 0.2 s a step, a marker file at a step


def on_cpu(out: Path) -> list[str]:
    return ["--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
            "--trainer.default_root_dir", str(out)]  # fmt: skip


def in_memory(digits: Path) -> list[str]:
    return ["--data.data_dir", str(digits), "--data.download", "false", "--data.batch_size", "32"]


def fit(out: Path, data: list[str], *more: str) -> list[str]:
    """train.py's arguments: the default experiment on CPU, writing to `out`."""
    return ["train.py", "fit", "--config", "configs/experiment.yaml", *data, *on_cpu(out), *more]


def start(project: Path, command: list[str], log: Path) -> subprocess.Popen:
    """`python COMMAND` in its own process group, as a platform starts a node; output to `log`."""
    with log.open("w") as output:  # the process writes its own copy
        return subprocess.Popen(
            [sys.executable, *command],
            cwd=project,
            env=launch_environment(project),
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def wait_for(path: Path, run: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert run.poll() is None, f"exited with {run.returncode} too early:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"{path.name} did not appear:\n{log.read_text()[-4000:]}"
        time.sleep(0.1)


def ending(run: subprocess.Popen, log: Path, within: float) -> tuple[int, float]:
    """The exit status and the seconds it took; a failure (after killing the group) past `within` seconds."""
    signalled = time.monotonic()
    try:
        code = run.wait(timeout=within)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        pytest.fail(f"still running {within} s after the signal:\n{log.read_text()[-4000:]}")
    return code, time.monotonic() - signalled


def assert_no_process_left(run: subprocess.Popen, log: Path, within: float = 5) -> None:
    """No process of the run's group is still running `within` seconds after it exited (zombies do not count)."""
    deadline = time.monotonic() + within
    while True:
        ps = ["ps", "-o", "pid=,stat=,args=", "-g", str(run.pid)]
        states = subprocess.run(ps, capture_output=True, text=True, check=False)
        left = [line for line in states.stdout.splitlines() if line.split()[1][0] != "Z"]
        if not left:
            return
        if time.monotonic() > deadline:
            os.killpg(run.pid, signal.SIGKILL)
            pytest.fail("left behind:\n" + "\n".join(left) + f"\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def saved_step(run_dir: Path) -> int:
    return torch.load(run_dir / "checkpoints" / "preempted.ckpt", weights_only=True, map_location="cpu")["global_step"]


@pytest.mark.parametrize("seconds", [1, 3, 5])
def test_sigterm_in_start_up_ends_every_process_at_once(default_project, real_mnist, tmp_path, seconds):
    # From the imports to the first training step: forming the job, loading data, the sanity check.
    log = tmp_path / "train.log"
    args = fit(tmp_path / "run", in_memory(real_mnist), "--trainer.devices", "2",
               PACED, "--trainer.callbacks.marker", str(tmp_path / "never"))  # fmt: skip
    run = start(default_project, args, log)
    time.sleep(seconds)
    run.send_signal(signal.SIGTERM)  # to the first process only, as Kubernetes and Docker do
    code, seconds_taken = ending(run, log, within=20)
    assert code == PREEMPTED, log.read_text()[-4000:]
    assert seconds_taken < 10, log.read_text()[-4000:]
    assert_no_process_left(run, log)


def test_sigterm_during_validation_ends_in_seconds_with_a_checkpoint(default_project, real_mnist, tmp_path):
    log, out, marker = tmp_path / "train.log", tmp_path / "run", tmp_path / "validating"
    validation_seconds = 13 * 3  # 800 held-out digits, 32 a batch: 13 batches a process, paced to 3 s each
    args = fit(out, in_memory(real_mnist), "--trainer.max_epochs", "2", "--trainer.devices", "2",
               "--trainer.limit_train_batches", "8")  # fmt: skip
    paced = ["--trainer.callbacks+=trainkit.testing.pacing.PaceValidation", "--trainer.callbacks.marker", str(marker),
             "--trainer.callbacks.seconds_per_batch", "3"]  # fmt: skip
    run = start(default_project, [*args, *paced], log)
    wait_for(marker, run, log)
    run.send_signal(signal.SIGTERM)
    code, seconds_taken = ending(run, log, within=validation_seconds + 60)
    assert code == PREEMPTED, log.read_text()[-4000:]
    assert seconds_taken < validation_seconds / 4, log.read_text()[-4000:]
    assert_no_process_left(run, log)
    assert saved_step(out) == 8  # the first epoch's steps: validation changes no weights

    resumed = subprocess.run([sys.executable, *args], cwd=default_project, env=launch_environment(default_project),
                             capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "preempted.ckpt" in resumed.stdout + resumed.stderr
    last = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    assert last["global_step"] == 16


@pytest.fixture(scope="module")
def real_chunks(default_project, real_mnist, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("chunks") / "mnist-chunks"
    command = [sys.executable, "-m", "trainkit.chunks", "--config", "configs/experiment.yaml",
               *in_memory(real_mnist), "--out", str(out)]  # fmt: skip
    result = subprocess.run(command, cwd=default_project, env=launch_environment(default_project),
                            capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.parametrize("data", ["in memory", "streamed"])
def test_sigterm_to_every_process_with_loader_workers_saves_a_checkpoint(
    default_project, real_mnist, real_chunks, tmp_path, data
):
    # Slurm's scancel and time limit signal every process of the job, the loader workers too.
    log, out, marker = tmp_path / "train.log", tmp_path / "run", tmp_path / "step-5"
    if data == "streamed":
        data_args = ["--data", "configs/data/streaming_images.yaml", "--data.input_dir", str(real_chunks)]
    else:
        data_args = in_memory(real_mnist)
    args = fit(out, data_args, "--trainer.devices", "2", "--data.num_workers", "2", "--data.batch_size", "32",
               PACED, "--trainer.callbacks.marker", str(marker), "--trainer.callbacks.at_step", "5")  # fmt: skip
    run = start(default_project, args, log)
    wait_for(marker, run, log)
    os.killpg(run.pid, signal.SIGTERM)
    code, _ = ending(run, log, within=60)
    assert code == PREEMPTED, log.read_text()[-4000:]
    assert "killed by signal" not in log.read_text()
    assert saved_step(out) > 5
    assert_no_process_left(run, log)


def test_ctrl_c_saves_a_checkpoint_exits_130_and_the_same_command_resumes(default_project, real_mnist, tmp_path):
    log, out, marker = tmp_path / "train.log", tmp_path / "run", tmp_path / "step-5"
    steps_per_epoch = 20
    args = fit(out, in_memory(real_mnist), "--trainer.max_epochs", "1", "--trainer.devices", "2",
               "--trainer.limit_train_batches", str(steps_per_epoch), "--data.num_workers", "2",
               PACED, "--trainer.callbacks.marker", str(marker), "--trainer.callbacks.at_step", "5")  # fmt: skip
    run = start(default_project, args, log)
    wait_for(marker, run, log)
    os.killpg(run.pid, signal.SIGINT)  # what a terminal sends to its foreground job on Ctrl-C
    code, _ = ending(run, log, within=60)
    assert code == INTERRUPTED, log.read_text()[-4000:]
    assert_no_process_left(run, log)
    stopped_at = saved_step(out)
    assert 5 < stopped_at < steps_per_epoch

    resumed = subprocess.run([sys.executable, *args], cwd=default_project, env=launch_environment(default_project),
                             capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "preempted.ckpt" in resumed.stdout + resumed.stderr
    last = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    assert last["global_step"] == steps_per_epoch


@pytest.mark.parametrize("to", ["the sweep", "every process"])
def test_a_sweep_preempted_early_exits_143_and_starts_no_more_trials(default_project, real_mnist, tmp_path, to):
    log, root = tmp_path / "sweep.log", tmp_path / "sweep"
    command = ["-m", "trainkit.sweep", "configs/sweep.yaml", "--count", "2", "--root", str(root),
               "--", *in_memory(real_mnist), *on_cpu(tmp_path / "unused"), "--trainer.max_epochs", "1"]  # fmt: skip
    run = start(default_project, command, log)
    wait_for(root / "0", run, log)  # the first trial has started
    time.sleep(2)
    if to == "the sweep":
        run.send_signal(signal.SIGTERM)  # the sweep is the container's command: the platform signals it alone
    else:
        os.killpg(run.pid, signal.SIGTERM)
    code, seconds_taken = ending(run, log, within=60)
    assert code == PREEMPTED, log.read_text()[-4000:]
    assert seconds_taken < 15, log.read_text()[-4000:]
    assert "failed (exit 143)" in log.read_text() and not (root / "1").exists()
    assert_no_process_left(run, log)


def test_as_pid_1_sigterm_during_the_imports_ends_the_run_at_once(default_project, real_mnist, tmp_path):
    # In a container train.py is PID 1, and the kernel drops signals PID 1 has no handler for:
    # `docker stop` would wait out its grace period. The handler must be there from the first lines.
    root_or_skip("a PID namespace (unshare --pid)")
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux)")
    log = tmp_path / "train.log"
    unshare = "import os, sys; os.execvp('unshare', ['unshare', '--pid', '--fork', '--mount-proc', *sys.argv[1:]])"
    in_a_pid_namespace = ["-c", unshare, sys.executable]
    run = start(default_project, [*in_a_pid_namespace, *fit(tmp_path / "run", in_memory(real_mnist))], log)
    deadline = time.monotonic() + 10
    while not (children := Path(f"/proc/{run.pid}/task/{run.pid}/children")).exists() or not children.read_text():
        assert time.monotonic() < deadline and run.poll() is None, log.read_text()
        time.sleep(0.01)
    train = int(children.read_text().split()[0])
    status = Path(f"/proc/{train}/status").read_text()
    assert "NSpid:" in status and status.split("NSpid:")[1].split("\n")[0].split()[-1] == "1", "not PID 1"

    def catches_sigterm() -> bool:
        caught = int(Path(f"/proc/{train}/status").read_text().split("SigCgt:")[1].split()[0], 16)
        return bool(caught & (1 << (signal.SIGTERM - 1)))

    deadline = time.monotonic() + 3  # python's start and the first lines; importing torch takes longer
    while not catches_sigterm():
        assert time.monotonic() < deadline, "train.py has no SIGTERM handler seconds after it started"
        time.sleep(0.01)
    os.kill(train, signal.SIGTERM)  # from outside its namespace, as the container runtime sends it
    code, seconds_taken = ending(run, log, within=30)
    assert code == PREEMPTED, log.read_text()[-4000:]
    assert seconds_taken < 5
