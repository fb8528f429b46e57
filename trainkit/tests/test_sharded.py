"""Sharded training (configs/strategy/fsdp.yaml) for real: 2 simulated nodes x 2 processes on 127.0.0.1, over gloo.

The model is the tests' tiny one as its author would make it ready for sharding (tiny.TinyShardedClassifier:
`fully_shard` per layer in configure_model). Dropout is off so that a run resumed on another number of processes
can match: each process draws its own dropout masks.
"""

import json
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from .drills import exit_code, full_epochs_args, node_envs, paced, start_nodes, wait_for, with_periodic
from .helpers import PROJECT_ROOT, TRAIN_SCRIPT, clean_env, free_port, run_train
from .test_async_saving import digests, save_and_change

pytestmark = pytest.mark.slow

SHARDED = PROJECT_ROOT / "configs" / "strategy" / "fsdp.yaml"
SHARDED_MODEL = "trainkit.testing.tiny.TinyShardedClassifier"
# 4 processes x 16 samples a step, 9 steps an epoch; on 2 processes, 32 each: the same samples in every step.
STEPS = 18


def sharded_args(experiment: Path, run_dir: Path, batch_size: int, devices: int) -> list[str]:
    return [
        "fit", *full_epochs_args(experiment, run_dir), "--config", str(SHARDED),
        "--model.class_path", SHARDED_MODEL, "--model.init_args.dropout", "0",
        "--data.batch_size", str(batch_size), "--trainer.devices", str(devices),
    ]  # fmt: skip


def two_nodes(platform: str, experiment: Path, run_dir: Path, reports: Path, *extra: str) -> list[subprocess.Popen]:
    port = free_port()
    command = [sys.executable, str(TRAIN_SCRIPT), *sharded_args(experiment, run_dir, 16, 2), "--cluster.main_port",
               str(port), "--trainer.callbacks+=trainkit.testing.rank_report.ReportRank", "--trainer.callbacks.out_dir",
               str(reports), *extra]  # fmt: skip
    return start_nodes([command, command], node_envs(platform, port), run_dir.parent / f"{run_dir.name}-logs")


def reports_of(folder: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(folder.glob("rank*.json"))]


def weights(checkpoint: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """The whole weights of a sharded checkpoint, gathered from every process's file by torch's converter."""
    whole = scratch / f"{checkpoint.parent.parent.name}-{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, whole)
    return torch.load(whole, weights_only=True)["state_dict"]


@pytest.fixture(scope="module")
def uninterrupted(experiment: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted sharded job on the POD platform: 2 pods x 2 processes, 2 epochs."""
    folder = tmp_path_factory.mktemp("sharded-reference")
    nodes = two_nodes("POD", experiment, folder / "run", folder / "reports")
    assert [exit_code(node, 300, "the sharded POD job hung") for node in nodes] == [0, 0], (
        folder / "run-logs" / "node0.log"
    ).read_text()[-4000:]
    return folder


def assert_sharded_four_ways(folder: Path, steps: int) -> None:
    """One job of 4 processes, each holding a part of the weights, the same weights gathered on each, and a
    committed last.ckpt with every process's shard."""
    reports = reports_of(folder / "reports")
    assert sorted(report["global_rank"] for report in reports) == [0, 1, 2, 3]
    assert {report["world_size"] for report in reports} == {4}
    assert {report["global_step"] for report in reports} == {steps}
    whole = reports[0]["parameters"]
    for report in reports:  # each process holds a part of the weights, and the parts make them whole
        assert report["parameters_held"] < whole, report
    assert sum(report["parameters_held"] for report in reports) == whole
    assert len({report["weights"] for report in reports}) == 1, "the gathered weights differ between processes"
    last = folder / "run" / "checkpoints" / "last.ckpt"
    assert sorted(path.name for path in last.glob("*.distcp")) == [f"__{rank}_0.distcp" for rank in range(4)]
    assert json.loads((last / "COMMITTED").read_text())["step"] == steps


def test_two_pods_of_two_processes_shard_every_weight_four_ways(uninterrupted):
    assert_sharded_four_ways(uninterrupted, STEPS)


def test_torchrun_two_nodes_train_one_sharded_job(experiment, tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    reports = tmp_path / "reports"
    report = [
        "--trainer.callbacks+=trainkit.testing.rank_report.ReportRank",
        "--trainer.callbacks.out_dir",
        str(reports),
    ]
    train = [*sharded_args(experiment, tmp_path / "run", 16, 2), "--trainer.max_epochs", "1", *report]
    commands = [
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank), "--rdzv-backend",
         "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "test", "--nproc-per-node", "2", str(TRAIN_SCRIPT), *train]
        for rank in range(2)
    ]  # fmt: skip
    nodes = start_nodes(commands, [clean_env(), clean_env()], tmp_path / "logs")
    assert [exit_code(node, 300, "the sharded torchrun job hung") for node in nodes] == [0, 0], (
        tmp_path / "logs" / "node0.log"
    ).read_text()[-4000:]
    assert_sharded_four_ways(tmp_path, STEPS // 2)


def test_a_preempted_sing_job_resumes_bitwise_and_on_two_processes_to_the_same_weights(
    uninterrupted, experiment, tmp_path
):
    run = tmp_path / "run"
    marker = tmp_path / "step-4"
    nodes = two_nodes("SING", experiment, run, tmp_path / "reports", *paced(marker, at_step=4))
    wait_for(marker, nodes[0], tmp_path / "run-logs" / "node0.log")
    for node in nodes:  # the platform stops every node
        node.send_signal(signal.SIGTERM)
    assert [exit_code(node, 120, "the preempted sharded job hung") for node in nodes] == [143, 143]
    preempted = run / "checkpoints" / "preempted.ckpt"
    stopped_at = json.loads((preempted / "COMMITTED").read_text())["step"]
    assert 4 < stopped_at < STEPS and stopped_at % 9, f"not mid-epoch: step {stopped_at}"
    on_two = tmp_path / "on-two-processes"
    shutil.copytree(run, on_two)

    nodes = two_nodes("SING", experiment, run, tmp_path / "reports")  # the same command: the job restarted
    assert [exit_code(node, 300, "the resumed sharded job hung") for node in nodes] == [0, 0]
    log = (tmp_path / "run-logs" / "node0.log").read_text()
    assert f"Restoring states from the checkpoint path at {preempted}" in log, log[-3000:]
    expected = {report["weights"] for report in reports_of(uninterrupted / "reports")}
    assert {report["weights"] for report in reports_of(tmp_path / "reports")} == expected, "not bitwise"

    # The same checkpoint on 1 node of 2 processes: torch reshards it; the weights agree to float rounding.
    result = run_train(*sharded_args(experiment, on_two, 32, 2), env=clean_env())
    assert result.returncode == 0, result.stderr[-4000:]
    reference = weights(uninterrupted / "run" / "checkpoints" / "last.ckpt", tmp_path)
    resharded = weights(on_two / "checkpoints" / "last.ckpt", tmp_path)
    assert resharded.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(resharded[name], tensor, rtol=0, atol=1e-6, msg=f"{name} after resharding")


@pytest.fixture(scope="module")
def one_process_run(experiment: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 1-process sharded run of 1 epoch (its checkpoints are directories)."""
    run = tmp_path_factory.mktemp("one-process") / "run"
    result = run_train(*sharded_args(experiment, run, 32, 1), "--trainer.max_epochs", "1", env=clean_env())
    assert result.returncode == 0, result.stderr[-4000:]
    return run


def test_a_save_killed_before_its_commit_leaves_the_checkpoint_before_it(experiment, tmp_path):
    run = tmp_path / "run"
    every_3_steps = with_periodic(experiment, every_n_steps=3)
    kill = ["--trainer.callbacks+=tests.sharded_faults.KillBeforeCommit", "--trainer.callbacks.at_step", "6"]
    killed = run_train(*sharded_args(every_3_steps, run, 32, 1), *kill, env=clean_env())
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    checkpoints = run / "checkpoints"
    assert json.loads((checkpoints / "periodic.ckpt" / "COMMITTED").read_text())["step"] == 3
    (unfinished,) = checkpoints.glob(".periodic.ckpt.partial-*")  # the shards of step 6, never committed
    assert list(unfinished.glob("*.distcp")) and not (unfinished / "COMMITTED").exists()

    resumed = run_train(*sharded_args(every_3_steps, run, 32, 1), env=clean_env())
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Restoring states from the checkpoint path at {checkpoints / 'periodic.ckpt'}" in resumed.stderr
    assert not list(checkpoints.glob(".*.partial-*")), "an unfinished save was left behind"


@pytest.mark.parametrize(
    "flags",
    [
        ["--trainer.fast_dev_run", "true"],
        ["--trainer.gradient_clip_val", "1.0", "--trainer.accumulate_grad_batches", "2",
         "--trainer.precision", "bf16-mixed", "--trainer.limit_train_batches", "4"],
    ],
    ids=["fast_dev_run", "clip-accumulate-bf16"],
)  # fmt: skip
def test_everyday_flags_train_sharded(flags, experiment, tmp_path):
    result = run_train(*sharded_args(experiment, tmp_path / "run", 32, 2), "--trainer.max_epochs", "1", *flags)
    assert result.returncode == 0, result.stderr[-4000:]
    saved = list((tmp_path / "run" / "checkpoints").glob("*.ckpt"))
    assert not saved if "--trainer.fast_dev_run" in flags else saved  # a fast_dev_run only tries the code


def test_a_model_that_shards_nothing_is_refused_in_one_line(experiment, tmp_path):
    args = sharded_args(experiment, tmp_path / "run", 32, 1)
    result = run_train(*args[: args.index("--model.class_path")], "--trainer.max_epochs", "1", env=clean_env())
    assert result.returncode == 2, result.stderr[-3000:]
    assert "TinyClassifier.configure_model() to shard the model" in last_words_of(result)


def test_a_sharded_checkpoint_that_does_not_fit_is_refused_in_one_line(one_process_run, experiment, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(one_process_run, run)
    wider = run_train(*sharded_args(experiment, run, 32, 1), "--model.init_args.hidden", "64", env=clean_env())
    assert wider.returncode == 2, wider.stderr[-3000:]
    assert "does not fit the model: net.2.weight is 32x16 in the checkpoint, 64x16 in the model" in wider.stderr
    not_sharded = run_train("fit", *full_epochs_args(experiment, run), env=clean_env())
    assert not_sharded.returncode == 2, not_sharded.stderr[-3000:]
    assert "is a sharded checkpoint" in last_words_of(not_sharded)


def test_an_async_sharded_checkpoint_holds_the_weights_of_its_step_though_training_changed_them(experiment, tmp_path):
    out = tmp_path / "saves"
    out.mkdir()
    args = [*sharded_args(experiment, tmp_path / "run", 32, 2), "--trainer.max_epochs", "1",
            "--checkpoint_saving.asynchronous", "true", *save_and_change(out, at_step=3)]  # fmt: skip
    result = run_train(*args, env=clean_env())
    assert result.returncode == 0, result.stderr[-4000:]
    record = json.loads((out / "at-step-3.json").read_text())
    assert set(record["saved"].values()).isdisjoint(record["changed"].values()), "the weights did not change"
    assert digests(weights(out / "at-step-3.ckpt", tmp_path)) == record["saved"]  # not the changed ones, nor a mix
    assert re.search(r"checkpoint at-step-3\.ckpt: training waited [\d.]+ s, written in [\d.]+ s", result.stderr)
    assert json.loads((tmp_path / "run" / "checkpoints" / "last.ckpt" / "COMMITTED").read_text())["step"] == 9


def last_words_of(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.strip().splitlines() if line.strip() and not line.startswith("wandb")]
    return lines[-1] if lines else ""
