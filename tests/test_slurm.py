"""The generated sbatch script runs under a real Slurm and its tasks form one Lightning DDP job.

A two-node cluster runs on this machine (see slurm_cluster.py); the generated
`launch/slurm/train.sbatch` is submitted unchanged, with sbatch options and train.py arguments
for CPUs and gloo on the command line, as a user overrides them. A job passes only if every
task joined one process group (world size = nodes x tasks, node rank from Slurm) and all ended
with the same weights. A third job is preempted mid-training the way the time limit does it and
must come back by itself and resume from the checkpoint it saved. The sharded strategy runs
through the same script: one job whose processes each hold a part of the weights and write their
shard of one checkpoint directory in the shared run directory.

Then the exit contract under a lost or stalled node (issue 32), on 2 nodes x 2 tasks with a
20-s cluster.timeout: a training process ended by SIGABRT, as NCCL's watchdog ends one, makes every
task end with 75 and the script requeue the job; a node whose processes freeze makes the other
node's tasks end with 75 within the timeout plus 30 s. Both of node 0's processes name the lost
node, also one blocked in a collective that the loss does not end. A training process whose main
thread hangs while its other threads run is named as stuck, and every task ends with 75. A node that freezes
while the job prepares its data (node 1 downloading) ends node 0's tasks with 75 in the same way.
"""

import contextlib
import os
import re
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from .host import root_or_skip
from .launch_runs import (
    SHARDED,
    TRAIN_STEPS,
    assert_one_process_group,
    assert_one_sharded_job,
    launch_environment,
    quick_cpu_run,
    write_fake_mnist,
)
from .slurm_cluster import SlurmCluster, free_port, install_packages, missing_programs

TASKS_PER_NODE = 2


def slurm_or_skip() -> None:
    """Install Slurm if needed; without root, skip (under CI, fail: it must run)."""
    root_or_skip("a real Slurm cluster (slurmd, munged, a private /etc/hosts per node)")
    if missing_programs():
        install_packages()
    assert not missing_programs(), f"still missing after installing: {missing_programs()}"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    slurm_or_skip()
    with SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=2, cpus_per_node=TASKS_PER_NODE) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def project(default_project, tmp_path_factory):
    """A copy of the default project: the job writes its log into the project root."""
    return Path(shutil.copytree(default_project, tmp_path_factory.mktemp("slurm-project") / default_project.name))


@pytest.fixture(scope="module")
def fake_mnist(project, tmp_path_factory):
    return write_fake_mnist(project, tmp_path_factory.mktemp("mnist"))


def submit(slurm: SlurmCluster, project: Path, data: Path, out: Path, nodes: int, *extra: str) -> str:
    """Submit the generated script as a user would, on CPUs: sbatch options, then train.py arguments."""
    sbatch_options = [
        f"--nodes={nodes}", f"--ntasks-per-node={TASKS_PER_NODE}", "--gres=none", "--cpus-per-task=1",
        "--time=10",
    ]  # fmt: skip
    # Lightning derives the port from the job id; a free one keeps concurrent test clusters apart.
    env = launch_environment(project, MASTER_PORT=str(free_port()))
    script = ["launch/slurm/train.sbatch", *quick_cpu_run(data, out), *extra]
    return slurm.sbatch([*sbatch_options, *script], env, project)


def job_log(slurm: SlurmCluster, project: Path, job: dict[str, str], job_id: str) -> str:
    path = project / f"{job['JobName']}-{job_id}.out"  # the script's own --output
    return path.read_text() if path.exists() else f"(no {path.name})\n{slurm.logs()}"


@pytest.mark.parametrize("nodes", [1, 2], ids=["1-node-x-2-tasks", "2-nodes-x-2-tasks"])
def test_generated_sbatch_script_trains_as_one_job(slurm, project, fake_mnist, tmp_path, nodes):
    job_id = submit(slurm, project, fake_mnist, tmp_path, nodes)
    job = slurm.wait(job_id)
    log = job_log(slurm, project, job, job_id)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), log[-6000:]
    assert f"job {job_id} (restart 0): {nodes} nodes x {TASKS_PER_NODE} tasks" in log

    world = nodes * TASKS_PER_NODE
    reports = assert_one_process_group(tmp_path, world, TASKS_PER_NODE, log)
    assert reports[0]["global_step"] == TRAIN_STEPS
    # The project itself saw Slurm and left the processes to srun.
    assert f"[Slurm] node_rank={nodes - 1} local_rank=1 global_rank={world - 1} world_size={world}" in log


def test_generated_sbatch_script_trains_one_sharded_job(slurm, project, fake_mnist, tmp_path):
    """2 nodes x 2 tasks, sharded: each task holds a part of the weights and writes its shard of last.ckpt.

    Both slurmd run on this host, so the run directory is shared as a cluster file system would be.
    """
    nodes = 2
    job_id = submit(slurm, project, fake_mnist, tmp_path, nodes, *SHARDED)
    job = slurm.wait(job_id)
    log = job_log(slurm, project, job, job_id)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), log[-6000:]

    assert_one_sharded_job(tmp_path, nodes * TASKS_PER_NODE, TASKS_PER_NODE, log)


def wait_for(condition, what: str, details, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout:g} s\n{details()}")
        time.sleep(0.3)


def requeued(job: dict[str, str]) -> bool:
    return job.get("JobState") == "PENDING" and job.get("Restarts") == "1"


def test_preempted_job_is_requeued_and_resumes(slurm, project, fake_mnist, tmp_path):
    """What the time limit does (`--signal=B:USR1@90`), done now: the job is requeued and resumes.

    The script requeues the job, Slurm sends SIGTERM to the tasks, they save a checkpoint at the
    end of a step and the requeued job resumes from it.

    A second config file sets max_steps: endless for the first run; once the job is requeued it is
    rewritten to 1, so the resumed run stops at once, at the step it restored.
    """
    limit = tmp_path / "limit.yaml"
    limit.write_text("trainer:\n  max_steps: 1000000\n  max_epochs: -1\n  limit_train_batches: 1.0\n")
    job_id = submit(slurm, project, fake_mnist, tmp_path, 1, "--config", str(limit))
    log_path = project / f"{slurm.job(job_id)['JobName']}-{job_id}.out"

    def log() -> str:
        return log_path.read_text() if log_path.exists() else ""

    # Preempt mid-training, as the time limit does: after the first epoch's checkpoint.
    wait_for(lambda: (tmp_path / "run" / "checkpoints" / "last.ckpt").exists(), "the first epoch", log)
    slurm.signal(job_id, "USR1", batch_script=True)
    # Requeued: the tasks have saved a checkpoint and ended, and the job waits to start again.
    wait_for(lambda: requeued(slurm.job(job_id)), "a requeue", log)
    limit.write_text("trainer:\n  max_steps: 1\n  max_epochs: -1\n")  # however many epochs it trained
    slurm.release(job_id)  # Slurm holds a requeued job back for a while; start it now
    job = slurm.wait(job_id)
    text = log()
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), text[-6000:]
    assert f"job {job_id}: time limit near, requeueing" in text, text[-6000:]
    assert f"job {job_id} (restart 1)" in text, text[-6000:]
    saved = re.search(r"SIGTERM: saved (\S+) at step (\d+)", text)
    assert saved, f"no checkpoint was saved when the job was stopped:\n{text[-6000:]}"
    assert f"Restoring states from the checkpoint path at {saved.group(1)}" in text
    reports = assert_one_process_group(tmp_path, TASKS_PER_NODE, TASKS_PER_NODE, text)
    assert reports[0]["global_step"] == int(saved.group(2)) > 0


# ---- A lost or stalled node: the exit contract under srun (issue 32) ---------------------------

DRILL_NODES = 2
WORLD = DRILL_NODES * TASKS_PER_NODE
DRILL_TIMEOUT_SECONDS = 20  # cluster.timeout: how long a collective waits for a peer
LOST_NODE = 75
SRUN_TASKS_EXITED = re.compile(r"srun: error: \S+: tasks? ([\d,-]+): Exited with exit code (\d+)")
LOST_CONTACT_LINE = re.compile(r"error: node \d+ \(global rank (\d+)\) lost contact.*")


@contextlib.contextmanager
def paced_job(slurm: SlurmCluster, project: Path, data: Path, out: Path, *extra: str) -> Iterator[tuple[str, Path]]:
    """A 2 nodes x 2 tasks job that trains until stopped, 0.2 s a step; entered once every task did step 3.

    Yields the job id and the marker whose `.rank<global rank>` files hold each training process's
    pid (trainkit.testing.pacing.PaceSteps). The job is cancelled on the way out.
    """
    marker = out / "step-3"
    job_id = submit(slurm, project, data, out, DRILL_NODES,
                    "--trainer.max_epochs", "1000", "--cluster.timeout", f"0:00:{DRILL_TIMEOUT_SECONDS}",
                    "--trainer.callbacks+=trainkit.testing.pacing.PaceSteps", "--trainer.callbacks.marker", str(marker),
                    "--trainer.callbacks.at_step", "3", *extra)  # fmt: skip
    try:
        wait_for(lambda: all(Path(f"{marker}.rank{rank}").exists() for rank in range(WORLD)),
                 "step 3 on every task", job_log_of(slurm, project, job_id), timeout=180)  # fmt: skip
        yield job_id, marker
    finally:
        slurm.cancel(job_id)


def job_log_of(slurm: SlurmCluster, project: Path, job_id: str) -> Callable[[], str]:
    return lambda: job_log(slurm, project, slurm.job(job_id), job_id)


def training_pid(marker: Path, rank: int) -> int:
    return int(Path(f"{marker}.rank{rank}").read_text())


def task_process(marker: Path, rank: int) -> int:
    """The process srun started for a task: the kit's parent, which runs the training process as its child."""
    stat = Path(f"/proc/{training_pid(marker, rank)}/stat").read_text()
    parent = int(stat.rpartition(")")[2].split()[1])  # the second field after the command name (it may hold spaces)
    assert b"train.py" in Path(f"/proc/{parent}/cmdline").read_bytes(), f"rank {rank}'s parent is not its task"
    return parent


def ended(pid: int) -> bool:
    """Whether the process has exited (slurmstepd, its parent, reaps it at once)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True


def task_statuses(log: str) -> dict[int, int]:
    """Each task's exit status as srun reported it: it names the tasks that ended non-zero, in ranges (0-1)."""
    statuses = {}
    for tasks, status in SRUN_TASKS_EXITED.findall(log):
        for part in tasks.split(","):
            first, _, last = part.partition("-")
            statuses.update(dict.fromkeys(range(int(first), int(last or first) + 1), int(status)))
    return statuses


def lost_contact_lines(log: str) -> dict[int, str]:
    """The line each process ended with on losing contact ("error: node N (global rank R) lost contact..."), by rank."""
    return {int(match.group(1)): match.group(0) for match in LOST_CONTACT_LINE.finditer(log)}


def names_only_node_1(line: str) -> bool:
    """Whether a survivor on node 0 blames node 1, and not its own node."""
    return "node 1 (host" in line and "node 0 (host" not in line


def test_an_aborted_training_process_ends_every_task_with_75_and_the_job_is_requeued(
    slurm, project, fake_mnist, tmp_path
):
    """SIGABRT, as NCCL's watchdog ends a process, to node 1's second training process (not its task's parent)."""
    aborted = WORLD - 1
    with paced_job(slurm, project, fake_mnist, tmp_path) as (job_id, marker):
        log = job_log_of(slurm, project, job_id)
        others = [task_process(marker, rank) for rank in range(WORLD) if rank != aborted]
        os.kill(training_pid(marker, aborted), signal.SIGABRT)
        started = time.monotonic()
        wait_for(lambda: all(map(ended, others)), "the end of the other tasks", log, DRILL_TIMEOUT_SECONDS + 30)
        print(f"the other tasks ended {time.monotonic() - started:.1f} s after the abort")
        wait_for(lambda: requeued(slurm.job(job_id)), "a requeue", log)
        text = log()
    assert task_statuses(text) == dict.fromkeys(range(WORLD), LOST_NODE), text[-6000:]
    assert f"job {job_id}: tasks ended with status {LOST_NODE}, requeueing" in text, text[-6000:]
    assert "error: the training process was aborted (SIGABRT)" in text, text[-6000:]
    lines = lost_contact_lines(text)
    assert sorted(lines) == [0, 1, 2], text[-6000:]
    assert names_only_node_1(lines[0]) and names_only_node_1(lines[1]), lines


def test_an_error_in_one_training_process_ends_every_task_with_its_status_and_no_requeue(
    slurm, project, fake_mnist, tmp_path
):
    """A bug that only node 1's second process meets (trainkit.testing.faults): a requeue would meet it again."""
    failing = WORLD - 1
    fault = ["--trainer.callbacks+=trainkit.testing.faults.FailOnOneProcess",
             "--trainer.callbacks.global_rank", str(failing), "--trainer.callbacks.at_step", "6"]  # fmt: skip
    with paced_job(slurm, project, fake_mnist, tmp_path, *fault) as (job_id, _):
        log = job_log_of(slurm, project, job_id)
        wait_for(lambda: slurm.job(job_id).get("JobState") == "FAILED", "the end of the job", log, 90)
        text = log()
    assert task_statuses(text) == dict.fromkeys(range(WORLD), 1), text[-6000:]
    assert f"job {job_id}: tasks ended with status" not in text, text[-6000:]  # the script requeued nothing
    said = rf"error: global rank {failing} \(node 1, host \S+\) failed with RuntimeError: a row that only global rank"
    ended = re.findall(rf"{said} {failing} reads \(a drill\): .* Global rank (\d) ends with it, exiting with 1", text)
    assert sorted(map(int, ended)) == [0, 1, 2], text[-6000:]


def stall_until_node_0_ends(stalled: list[int], survivors: list[int], log: Callable[[], str]) -> str:
    """Freeze the `stalled` processes (SIGSTOP), wait until node 0's tasks (`survivors`) have ended and srun has
    written their statuses, then kill what was frozen (otherwise srun waits for it until the time limit). The log."""
    try:
        for pid in stalled:
            os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        wait_for(lambda: all(map(ended, survivors)), "the end of node 0's tasks", log, DRILL_TIMEOUT_SECONDS + 30)
        print(f"node 0's tasks ended {time.monotonic() - started:.1f} s after node 1 stalled")
        # srun writes a task's status a moment after the task ended
        wait_for(lambda: {0, 1} <= task_statuses(log()).keys(), "srun's statuses of node 0's tasks", log, 30)
        return log()
    finally:
        for pid in stalled:
            for signum in (signal.SIGKILL, signal.SIGCONT):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)


def test_a_stalled_node_ends_the_other_tasks_with_75_within_the_timeout(slurm, project, fake_mnist, tmp_path):
    """Node 1's tasks freeze (SIGSTOP), their connections open, as beside a hung driver; slurmstepd goes on."""
    with paced_job(slurm, project, fake_mnist, tmp_path) as (job_id, marker):
        log = job_log_of(slurm, project, job_id)
        stalled = [pid for rank in (2, 3) for pid in (task_process(marker, rank), training_pid(marker, rank))]
        text = stall_until_node_0_ends(stalled, [task_process(marker, rank) for rank in (0, 1)], log)
    statuses = task_statuses(text)
    assert {rank: statuses.get(rank) for rank in (0, 1)} == {0: LOST_NODE, 1: LOST_NODE}, text[-6000:]
    lines = lost_contact_lines(text)
    assert names_only_node_1(lines.get(0, "")), text[-6000:]
    assert "global ranks 2, 3)" in lines[0], lines  # both stalled, neither answered
    assert names_only_node_1(lines.get(1, "")), text[-6000:]


# The project's own MNIST data, whose download on node 1 computes for `seconds` (an unzip, a checksum):
# written into the project copy, beside train.py, so that `--data slow_mnist.SlowMNIST` finds it.
SLOW_MNIST = """
import time
from pathlib import Path

from {package}.data.mnist import MNISTDataModule


class SlowMNIST(MNISTDataModule):
    def __init__(self, marker: str, seconds: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.marker, self.seconds = Path(marker), seconds

    def prepare_data(self) -> None:
        if self.trainer.node_rank == 1:
            self.marker.touch()
            deadline = time.monotonic() + self.seconds
            while time.monotonic() < deadline:
                sum(range(10_000))
"""


def processes_of_node(job_id: str, node: int) -> list[int]:
    """The task processes and training processes that srun started on `node` for this job (by their environment;
    srun itself, on node 0, runs `srun python train.py` and is not one of them)."""
    wanted = {f"SLURM_JOB_ID={job_id}".encode(), f"SLURM_NODEID={node}".encode()}
    found = []
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            command = (proc / "cmdline").read_bytes().split(b"\0") if proc.name.isdigit() else []
            ours = b"train.py" in command and Path(command[0].decode()).name != "srun"
            if ours and wanted <= set((proc / "environ").read_bytes().split(b"\0")):
                found.append(int(proc.name))
    return found


def test_a_node_that_freezes_while_preparing_data_ends_the_other_tasks_with_75(slurm, project, fake_mnist, tmp_path):
    """Node 1's tasks freeze (SIGSTOP) while node 1 downloads, before training: Lightning's barrier around
    prepare_data has no timeout of its own, so only the kit's signs of life end node 0's tasks."""
    package = next(path.parent.parent.name for path in (project / "src").glob("*/data/mnist.py"))
    (project / "slow_mnist.py").write_text(SLOW_MNIST.format(package=package))
    marker = tmp_path / "downloading"
    job_id = submit(slurm, project, fake_mnist, tmp_path, DRILL_NODES,
                    "--cluster.timeout", f"0:00:{DRILL_TIMEOUT_SECONDS}", "--data", "slow_mnist.SlowMNIST",
                    "--data.marker", str(marker), "--data.seconds", "600")  # fmt: skip
    log = job_log_of(slurm, project, job_id)
    try:
        wait_for(lambda: marker.exists() or task_statuses(log()), "node 1's download", log, timeout=180)
        assert marker.exists(), log()  # not a task that ended before
        stalled, survivors = processes_of_node(job_id, 1), processes_of_node(job_id, 0)
        assert len(stalled) == len(survivors) == 2 * TASKS_PER_NODE, (stalled, survivors)  # tasks and their children
        text = stall_until_node_0_ends(stalled, survivors, log)
    finally:
        slurm.cancel(job_id)
    statuses = task_statuses(text)
    assert {rank: statuses.get(rank) for rank in (0, 1)} == {0: LOST_NODE, 1: LOST_NODE}, text[-6000:]
    lines = lost_contact_lines(text)
    assert all(names_only_node_1(lines.get(rank, "")) for rank in (0, 1)), text[-6000:]
    assert all("while it prepared data" in lines[rank] for rank in (0, 1)), lines


def test_a_training_process_whose_main_thread_hangs_is_named_and_every_task_ends_with_75(
    slurm, project, fake_mnist, tmp_path
):
    """Node 1's second training process hangs in its main thread while its other threads run on, as in a hung
    device call or file read: it answers when asked, so only where its main thread is tells it apart."""
    stuck = WORLD - 1
    hang = ["--trainer.callbacks+=trainkit.testing.pacing.HangAtStep", "--trainer.callbacks.rank", str(stuck)]
    with paced_job(slurm, project, fake_mnist, tmp_path, *hang) as (job_id, marker):
        log = job_log_of(slurm, project, job_id)
        tasks = [task_process(marker, rank) for rank in range(WORLD)]
        started = time.monotonic()
        wait_for(lambda: all(map(ended, tasks)), "the end of every task", log, DRILL_TIMEOUT_SECONDS + 45)
        print(f"every task ended {time.monotonic() - started:.1f} s after step 3")
        wait_for(lambda: requeued(slurm.job(job_id)), "a requeue", log)
        text = log()
    assert task_statuses(text) == dict.fromkeys(range(WORLD), LOST_NODE), text[-6000:]
    lines = lost_contact_lines(text)
    assert sorted(lines) == [0, 1, 2], text[-6000:]
    assert all(f"stuck: global rank {stuck} (node 1, host" in line for line in lines.values()), lines
    assert f"error: global rank {stuck} is stuck at " in text and "in on_train_batch_end" in text, text[-6000:]
