"""Drills: run `train.py` as a platform runs a node, interrupt it for real, and read what it left behind."""

import re
import subprocess
import sys
from pathlib import Path

import yaml

from trainkit.cli import DEFAULTS
from trainkit.testing.runs import exit_code, load, paced, wait_for, whole_epochs

from .helpers import PROJECT_ROOT, TRAIN_SCRIPT, clean_env, quick_run_args, start

# Re-exported: the drills use them together with what this module defines.
__all__ = ["exit_code", "load", "paced", "start", "wait_for", "whole_epochs"]

STEPS_PER_EPOCH = 18  # the tiny data's 576 training images, batches of 32
TWO_PROCESS_STEPS_PER_EPOCH = STEPS_PER_EPOCH // 2  # each process takes half of every epoch


def full_epochs_args(experiment: Path, run_dir: Path, epochs: int = 2) -> list[str]:
    """Whole epochs (not a few batches), so that an interruption can land mid-epoch."""
    return [*quick_run_args(experiment, run_dir), *whole_epochs(epochs)]


def group_is_gone(process: subprocess.Popen) -> bool:
    """No process of the job's process group is still running (exited ones awaiting reaping do not count)."""
    states = subprocess.run(["ps", "-o", "stat=", "-g", str(process.pid)], capture_output=True, text=True).stdout
    return all(state.startswith("Z") for state in states.split())


def process_tree(pid: int) -> list[int]:
    """`pid` and every process started under it, as /proc shows them now."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # the parent id is the second field after the command name, which may hold spaces
            children.setdefault(int(stat.read_text().rpartition(")")[2].split()[1]), []).append(int(stat.parent.name))
        except (OSError, ValueError):
            continue  # ended meanwhile
    tree, queue = [], [pid]
    while queue:
        tree.append(queue.pop())
        queue.extend(children.get(tree[-1], []))
    return tree


def last_words(log: Path) -> str:
    """The last line a node printed before wandb's closing lines, without torch's rank prefix."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in log.read_text().strip().splitlines()]
    lines = [re.sub(r"^\[rank\d+\]: ", "", line) for line in lines if line.strip() and not line.startswith("wandb")]
    return re.sub(r"^\[rank\d+\]: ", "", lines[-1]) if lines else ""


def start_node(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """One node: its own process tree (session), output to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as output:  # the node writes its own copy
        return subprocess.Popen(
            command, cwd=PROJECT_ROOT, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )


def start_nodes(commands: list[list[str]], envs: list[dict[str, str]], logs: Path) -> list[subprocess.Popen]:
    return [
        start_node(command, env, logs / f"node{index}.log")
        for index, (command, env) in enumerate(zip(commands, envs, strict=True))
    ]


def node_envs(platform: str, port: int) -> list[dict[str, str]]:
    if platform == "SING":
        # SING sets no port variable: both nodes use the configured cluster.main_port.
        common = {"SING_WORLD_SIZE": "2", "SING_JOB_NAME": "test", "SING_MASTER_ADDR": "127.0.0.1",
                  "SING_HOSTNAME_SUFFIX": "test-service.demo-project.svc.cluster.local"}  # fmt: skip
        return [clean_env(**common, SING_RANK=str(rank)) for rank in range(2)]
    common = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
              "JOB_NAME": "test", "SVC_NAME": "test-service", "POD_NAMESPACE": "demo-project"}  # fmt: skip
    return [clean_env(**common, RANK=str(rank)) for rank in range(2)]


def two_node_job(
    platform: str, args: list[str], port: int, processes: int = 2
) -> tuple[list[list[str]], list[dict[str, str]]]:
    """Each node's command and environment for `train.py ARGS` on 2 nodes x `processes` processes on `platform`."""
    if platform == "torchrun":
        endpoint = f"127.0.0.1:{port}"
        # Through the kit's wrapper, as the recipes run torchrun; the first node hosts the rendezvous, as
        # the machine named by MASTER_ADDR does (both would match 127.0.0.1 here).
        commands = [
            [sys.executable, "-m", "trainkit.cluster.torchrun", "--nnodes", "2", "--node-rank", str(rank),
             "--nproc-per-node", str(processes), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
             "--rdzv-id", "drill", "--rdzv-conf", f"is_host={int(rank == 0)}", str(TRAIN_SCRIPT), *args]
            for rank in range(2)
        ]  # fmt: skip
        return commands, [clean_env(), clean_env()]
    command = [sys.executable, str(TRAIN_SCRIPT), *args, "--trainer.devices", str(processes),
               "--cluster.main_port", str(port)]  # fmt: skip
    return [command, command], node_envs(platform, port)


def with_periodic(experiment: Path, **init_args: float) -> Path:
    """The experiment with the periodic checkpoint's settings replaced, written beside it."""
    config = yaml.safe_load(experiment.read_text())
    trainer = config.setdefault("trainer", {})
    # A list is replaced as a whole: the kit's callbacks, restated with this one change.
    trainer.setdefault("callbacks", yaml.safe_load(DEFAULTS.read_text())["trainer"]["callbacks"])
    for callback in trainer["callbacks"]:
        if callback["class_path"].endswith(".PeriodicCheckpoint"):
            callback["init_args"] = init_args
    path = experiment.with_name("periodic-" + "-".join(f"{key}-{value}" for key, value in init_args.items()) + ".yaml")
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path
