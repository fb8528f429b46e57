"""Helpers for running a generated project's launch scripts for real, on CPU, as a user would."""

import importlib.util
import json
import os
import sys
from pathlib import Path

TRAIN_STEPS = 4
CLUSTER_VARIABLES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                     "JOB_NAME", "SVC_NAME", "POD_NAMESPACE"}  # fmt: skip
CLUSTER_PREFIXES = ("SLURM_", "SING_", "TORCHELASTIC_", "PET_", "POD_", "PL_")


def write_fake_mnist(project: Path, root: Path) -> Path:
    """Small synthetic MNIST files, written by the generated project's own test helper."""
    spec = importlib.util.spec_from_file_location("fake_mnist", project / "tests" / "example" / "fake_mnist.py")
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)
    return helpers.write_fake_mnist(root)


def launch_environment(project: Path, **variables: str) -> dict[str, str]:
    """This environment without any cluster variables, with the project importable, plus `variables`."""
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in CLUSTER_VARIABLES and not name.startswith(CLUSTER_PREFIXES)
    }
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",  # python and torchrun of this venv
        PYTHONPATH=str(project / "src"),  # stands in for `pip install -e .`
        WANDB_MODE="offline",
        PYTHONUNBUFFERED="1",
        **variables,
    )
    return env


def quick_cpu_run(data: Path, out: Path) -> list[str]:
    """train.py arguments: a few steps on CPU over gloo; each rank reports to out/reports/."""
    return [
        "--trainer.accelerator", "cpu",
        "--trainer.max_epochs", "1",
        "--trainer.limit_train_batches", str(TRAIN_STEPS),
        "--trainer.limit_val_batches", "2",
        "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(out / "run"),
        "--data.data_dir", str(data),
        "--data.download", "false",
        "--data.batch_size", "32",
        "--trainer.callbacks+=trainkit.testing.rank_report.ReportRank",
        "--trainer.callbacks.out_dir", str(out / "reports"),
    ]  # fmt: skip


# What the kit sets in every process for NCCL's watchdog and flight recorder (trainkit/run/nccl.py).
NCCL_DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    "TORCH_FR_BUFFER_SIZE": "2000",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
}


def rank_reports(out: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted((out / "reports").glob("rank*.json"))]


def assert_one_process_group(out: Path, world: int, processes_per_node: int, log: str = "") -> list[dict]:
    """Every rank reported, all in one job of `world` processes, placed by node, with the same weights."""
    reports = rank_reports(out)
    assert sorted(report["global_rank"] for report in reports) == list(range(world)), log[-4000:]
    for report in reports:
        assert report["world_size"] == world
        assert report["node_rank"] == report["global_rank"] // processes_per_node
        assert report["local_rank"] == report["global_rank"] % processes_per_node
        settings = report["nccl_settings"]  # what the kit sets in every process (trainkit/run/nccl.py)
        # torchrun sets its own 1, which also ends a process whose collective failed (SIGABRT).
        assert settings["TORCH_NCCL_ASYNC_ERROR_HANDLING"] in ("1", "3"), settings
        assert settings["TORCH_FR_BUFFER_SIZE"] == NCCL_DEFAULTS["TORCH_FR_BUFFER_SIZE"], "no flight recorder"
        assert settings["TORCH_NCCL_DUMP_ON_TIMEOUT"] == NCCL_DEFAULTS["TORCH_NCCL_DUMP_ON_TIMEOUT"], "no dump"
    assert len({report["weights"] for report in reports}) == 1, "ranks ended with different weights"
    assert len({report["global_step"] for report in reports}) == 1
    return reports


# The sharded strategy on the tests' tiny model, as its author would make it ready for sharding.
SHARDED = ["--config", "configs/strategy/fsdp.yaml",
           "--model.class_path", "trainkit.testing.tiny.TinyShardedClassifier"]  # fmt: skip


def assert_one_sharded_job(out: Path, world: int, processes_per_node: int, log: str = "") -> None:
    """One job (assert_one_process_group) whose processes each held a part of the weights, and one committed
    checkpoint directory in `out/run/checkpoints` with every process's shard and nothing half-saved beside it."""
    reports = assert_one_process_group(out, world, processes_per_node, log)  # incl. the same gathered weights
    assert reports[0]["global_step"] == TRAIN_STEPS
    whole = reports[0]["parameters"]
    assert all(report["parameters_held"] < whole for report in reports), reports
    assert sum(report["parameters_held"] for report in reports) == whole, reports
    checkpoints = out / "run" / "checkpoints"
    last = checkpoints / "last.ckpt"
    assert last.is_dir(), log[-4000:]
    assert not list(checkpoints.glob(".*")), "a save or the shared-directory probe left a hidden file behind"
    assert sorted(path.name for path in last.glob("*.distcp")) == [f"__{rank}_0.distcp" for rank in range(world)]
    committed = json.loads((last / "COMMITTED").read_text())
    assert (committed["step"], committed["world_size"]) == (TRAIN_STEPS, world), committed
