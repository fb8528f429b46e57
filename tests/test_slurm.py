"""The generated sbatch script runs under a real Slurm and its tasks form one Lightning DDP job.

A two-node cluster runs on this machine (see slurm_cluster.py); the generated
`launch/slurm/train.sbatch` is submitted unchanged, with sbatch options and train.py arguments
for CPUs and gloo on the command line, as a user overrides them. A job passes only if every
task joined one process group (world size = nodes x tasks, node rank from Slurm) and all ended
with the same weights. A third job is preempted mid-training the way the time limit does it and
must come back by itself and resume from the checkpoint it saved. The sharded strategy runs
through the same script: one job whose processes each hold a part of the weights and write their
shard of one checkpoint directory in the shared run directory.
"""

import re
import shutil
import time
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
from .slurm_cluster import SlurmCluster, free_ports, install_packages, missing_programs

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
    env = launch_environment(project, MASTER_PORT=str(free_ports(1)[0]))
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
