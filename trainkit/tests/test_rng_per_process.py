"""Each process's random number generators resume as its own: a job whose processes draw apart (tasks.rank_noise:
seeded per rank, dropout and noise from torch, numpy and Python) resumes bitwise, with DDP and sharded, and on
another number of processes; a checkpoint of the earlier format (one state for every process) still resumes.
"""

import random
import shutil
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from trainkit.checkpoints.rng_state import RNGStateCheckpoint, current_state
from trainkit.testing.training_samples import recorded

from .drills import TWO_PROCESS_STEPS_PER_EPOCH, full_epochs_args, group_is_gone, load, paced, start, wait_for
from .helpers import clean_env, run_train
from .test_sharded import SHARDED, weights


def args(experiment: Path, run_dir: Path, devices: int, *extra: str) -> list[str]:
    return ["fit", *full_epochs_args(experiment, run_dir), "--model", "tasks.rank_noise.RankNoise",
            "--trainer.devices", str(devices), *extra]  # fmt: skip


@pytest.mark.slow
def test_each_process_resumes_its_own_generators_and_samples_bitwise_and_on_other_process_counts(experiment, tmp_path):
    """SIGTERM mid-epoch to the job's first process (as Kubernetes and Docker send it), 2 loader workers each, then
    the same command: each process trains on the same samples in the same order, with its own draws, to the same
    weights: the kit's mid-epoch resume of in-memory data on 2 processes."""
    record = ["--data.num_workers", "2", "--trainer.callbacks+=trainkit.testing.training_samples.RecordTrainingSamples"]

    def two_processes(run: str, *extra: str) -> list[str]:
        return args(experiment, tmp_path / run, 2, *record, "--trainer.callbacks.out_dir",
                    str(tmp_path / run / "samples"), *extra)  # fmt: skip

    uninterrupted = run_train(*two_processes("uninterrupted"))
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-4000:]

    marker, log = tmp_path / "step-4", tmp_path / "interrupted.log"
    job = start(two_processes("resumed", *paced(marker, at_step=4)), clean_env(), log)
    wait_for(marker, job, log)
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=60) == 143, log.read_text()[-4000:]
    time.sleep(1)
    assert group_is_gone(job), "a process of the job is still running"
    checkpoints = tmp_path / "resumed" / "checkpoints"
    preempted = load(checkpoints / "preempted.ckpt")
    assert preempted["global_step"] % TWO_PROCESS_STEPS_PER_EPOCH, "the interruption must land mid-epoch"
    assert preempted["optimizer_states"] and preempted["lr_schedulers"] and preempted["loops"]
    assert not [path for path in checkpoints.iterdir() if path.name.startswith(".")], "temporary files left"
    ranks = preempted["callbacks"]["RNGStateCheckpoint"]["ranks"]
    assert len(ranks) == 2 and not torch.equal(ranks[0]["torch"], ranks[1]["torch"]), "the processes drew alike"
    (tmp_path / "on-one" / "checkpoints").mkdir(parents=True)
    shutil.copy(checkpoints / "preempted.ckpt", tmp_path / "on-one" / "checkpoints")

    resumed = run_train(*two_processes("resumed"))
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-4000:]
    assert "preempted.ckpt" in output and "not resumable" not in output
    assert not (checkpoints / "preempted.ckpt").exists()
    for rank in range(2):
        samples = [recorded(tmp_path / run / "samples", rank) for run in ("uninterrupted", "resumed")]
        assert samples[1] == samples[0], f"rank {rank} trained on other samples, or in another order, after resuming"
    expected, actual = (load(tmp_path / run / "checkpoints" / "last.ckpt") for run in ("uninterrupted", "resumed"))
    assert actual["global_step"] == expected["global_step"] == 2 * TWO_PROCESS_STEPS_PER_EPOCH
    for name, tensor in expected["state_dict"].items():
        assert torch.equal(tensor, actual["state_dict"][name]), f"{name} differs after resuming"

    # The same checkpoint on 1 process (it keeps rank 0's state), then that run's on 2 (rank 1 gets a derived one).
    fewer = run_train(*args(experiment, tmp_path / "on-one", 1))
    assert fewer.returncode == 0, fewer.stderr[-4000:]
    assert "preempted.ckpt" in fewer.stdout + fewer.stderr
    assert len(load(tmp_path / "on-one" / "checkpoints" / "last.ckpt")["callbacks"]["RNGStateCheckpoint"]["ranks"]) == 1
    more = run_train(*args(experiment, tmp_path / "on-one", 2, "--trainer.max_epochs", "3"))
    assert more.returncode == 0, more.stderr[-4000:]
    assert load(tmp_path / "on-one" / "checkpoints" / "last.ckpt")["epoch"] == 2


@pytest.mark.slow
def test_a_sharded_job_resumes_each_processs_generators_bitwise(experiment, tmp_path):
    # The sharded strategy's first process writes the callbacks' state (meta.pt); every process reads it back.
    uninterrupted = run_train(*args(experiment, tmp_path / "uninterrupted", 2, "--config", str(SHARDED)))
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-4000:]

    marker, log = tmp_path / "step-4", tmp_path / "interrupted.log"
    job = start(args(experiment, tmp_path / "resumed", 2, "--config", str(SHARDED), *paced(marker, at_step=4)),
                clean_env(), log)  # fmt: skip
    wait_for(marker, job, log)
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=60) == 143, log.read_text()[-4000:]

    resumed = run_train(*args(experiment, tmp_path / "resumed", 2, "--config", str(SHARDED)))
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    expected, actual = (
        weights(tmp_path / run / "checkpoints" / "last.ckpt", tmp_path) for run in ("uninterrupted", "resumed")
    )
    for name, tensor in expected.items():
        assert torch.equal(tensor, actual[name]), f"{name} differs after resuming"
    meta = load(tmp_path / "resumed" / "checkpoints" / "last.ckpt" / "meta.pt")
    assert len(meta["callbacks"]["RNGStateCheckpoint"]["ranks"]) == 2


def test_a_checkpoint_of_the_earlier_format_resumes_the_first_process_and_derives_the_others():
    def draw() -> list[float]:
        return [*torch.rand(2).tolist(), np.random.rand(), random.random()]

    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    earlier = current_state()  # the earlier format: one process's state, in the same form
    expected = draw()
    callback = RNGStateCheckpoint()
    resumed = {}
    for rank in (0, 1, 1):
        callback.load_state_dict(earlier)
        callback.on_train_start(SimpleNamespace(global_rank=rank), None)
        resumed.setdefault(rank, []).append(draw())
    assert resumed[0] == [expected]
    assert resumed[1][0] == resumed[1][1] != expected, "rank 1's stream is not its own and reproducible"
