"""Shared test helpers: a way to run `train.py` for real, as a user runs it, and the environment to run it in.

The machinery's tests (tests/machinery/) train a tiny model and data of their own; the example's tests
(tests/example/) go when the example goes.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
TRAIN_SCRIPT = PROJECT_ROOT / "train.py"
EXPERIMENT = PROJECT_ROOT / "configs" / "experiment.yaml"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def quick_run_args(config: Path, run_dir: Path) -> list[str]:
    """`fit` with the experiment `config` for a few steps of 32 samples, on CPU, with no logger service."""
    return ["--config", str(config), "--data.batch_size", "32", *quick_trainer_args(run_dir)]


def quick_trainer_args(run_dir: Path) -> list[str]:
    return [
        "--trainer.accelerator", "cpu",
        "--trainer.max_epochs", "1",
        "--trainer.limit_train_batches", "4",
        "--trainer.limit_val_batches", "2",
        "--trainer.default_root_dir", str(run_dir),
        "--trainer.enable_progress_bar", "false",
    ]  # fmt: skip


def clean_env(**variables: str) -> dict[str, str]:
    """This process's environment without any cluster variables, plus `variables`."""
    cluster_prefixes = ("SING_", "SLURM_", "TORCHELASTIC_", "POD_", "PL_")
    cluster_names = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                     "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "JOB_NAME", "SVC_NAME", "POD_NAMESPACE"}  # fmt: skip
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in cluster_names and not name.startswith(cluster_prefixes)
    }
    env.update(WANDB_MODE="offline", PYTHONUNBUFFERED="1", **variables)
    return env


def run_train(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `python train.py ARGS` as a user would, from the project root."""
    return subprocess.run(
        [sys.executable, str(TRAIN_SCRIPT), *args],
        cwd=PROJECT_ROOT,
        env=env or clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
