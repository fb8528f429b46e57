"""Each process's random number generators resume as its own: a job whose processes draw apart (tasks.rank_noise:
seeded per rank, dropout and noise from torch, numpy and Python) resumes bitwise, with DDP and sharded, and on
another number of processes; a checkpoint of the earlier format (one state for every process) still resumes.
"""

import random
import shutil
import signal
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from trainkit.checkpoints.rng_state import RNGStateCheckpoint, current_state

from .drills import TWO_PROCESS_STEPS_PER_EPOCH, full_epochs_args, load, paced, start, wait_for
from .helpers import clean_env, run_train
from .test_sharded import SHARDED, weights


def args(experiment: Path, run_dir: Path, devices: int, *extra: str) -> list[str]:
    return ["fit", *full_epochs_args(experiment, run_dir), "--model", "tasks.rank_noise.RankNoise",
            "--trainer.devices", str(devices), *extra]  # fmt: skip


@pytest.mark.slow
def test_each_process_resumes_its_own_generators_bitwise_and_on_other_process_counts(experiment, tmp_path):
    uninterrupted = run_train(*args(experiment, tmp_path / "uninterrupted", 2))
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-4000:]

    marker, log = tmp_path / "step-4", tmp_path / "interrupted.log"
    job = start(args(experiment, tmp_path / "resumed", 2, *paced(marker, at_step=4)), clean_env(), log)
    wait_for(marker, job, log)
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=60) == 143, log.read_text()[-4000:]
    preempted = tmp_path / "resumed" / "checkpoints" / "preempted.ckpt"
    assert load(preempted)["global_step"] % TWO_PROCESS_STEPS_PER_EPOCH, "the interruption must land mid-epoch"
    (tmp_path / "on-one" / "checkpoints").mkdir(parents=True)
    shutil.copy(preempted, tmp_path / "on-one" / "checkpoints")

    resumed = run_train(*args(experiment, tmp_path / "resumed", 2))
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    expected, actual = (load(tmp_path / run / "checkpoints" / "last.ckpt") for run in ("uninterrupted", "resumed"))
    assert actual["global_step"] == expected["global_step"] == 2 * TWO_PROCESS_STEPS_PER_EPOCH
    for name, tensor in expected["state_dict"].items():
        assert torch.equal(tensor, actual["state_dict"][name]), f"{name} differs after resuming"

    ranks = load(tmp_path / "on-one" / "checkpoints" / "preempted.ckpt")["callbacks"]["RNGStateCheckpoint"]["ranks"]
    assert len(ranks) == 2 and not torch.equal(ranks[0]["torch"], ranks[1]["torch"]), "the processes drew alike"

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
