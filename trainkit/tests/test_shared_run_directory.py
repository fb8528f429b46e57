"""Nodes that share the run directory start at the same moment, each in a container of its own.

A container is a PID namespace of its own, so every node's first process has the same pid: a file
name made from the pid is the same file on every node. Here each node is a process in a PID
namespace of its own (`unshare --pid`, as a container runtime makes one), and all of them write the
run's wandb id into one directory at the same instant, many times over.
"""

import os
import shutil
import subprocess
import sys
import time

import pytest

from trainkit.checkpoints.stored import RUN_ID
from trainkit.store.object_store import open_store

from .helpers import clean_env

NODES = 4
ROUNDS = 25
ROUND_SECONDS = 0.3
STORED_ID = "0badc0de"  # the id an earlier job's store keeps: every node then replaces its own

START_AT_ONCE = """
import sys, time
from pathlib import Path
from jsonargparse import Namespace
from trainkit.checkpoints.stored import keep_run_id_in_store
from trainkit.store.object_store import open_store
from trainkit.tracking.wandb_logger import keep_wandb_run_id

root, start, rounds, every = Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
for round in range(rounds):
    while time.time() < start + round * every:
        pass
    logger = Namespace(init_args=Namespace(id=None))
    checkpoints = root / f"round-{round}" / "checkpoints"
    keep_wandb_run_id(logger, checkpoints)
    kept = keep_run_id_in_store(open_store(f"file://{root}/store-{round}", 10), checkpoints)
    print(round, kept)  # the id the job logs to (the command line takes the store's)
"""


def pid_namespaces_or_skip() -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a PID namespace of its own for each node (unshare --pid) needs root")


def test_nodes_whose_processes_have_the_same_pid_agree_on_the_runs_wandb_id(tmp_path):
    pid_namespaces_or_skip()
    for round in range(ROUNDS):
        open_store(f"file://{tmp_path}/store-{round}", 10).write(RUN_ID, STORED_ID.encode(), replacing=None)
    start = time.time() + 15  # every node has imported by then, on a busy machine too
    command = [sys.executable, "-c", START_AT_ONCE, str(tmp_path), str(start), str(ROUNDS), str(ROUND_SECONDS)]
    nodes = [
        subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", *command], env=clean_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(NODES)
    ]  # fmt: skip
    outcomes = [node.communicate(timeout=120) for node in nodes]
    for node, (_, errors) in zip(nodes, outcomes, strict=True):
        assert node.returncode == 0, errors[-3000:]
    for round in range(ROUNDS):
        said = {line for output, _ in outcomes for line in output.splitlines() if line.startswith(f"{round} ")}
        assert said == {f"{round} {STORED_ID}"}, said  # every node logs to the run the store keeps
        checkpoints = tmp_path / f"round-{round}" / "checkpoints"
        assert (checkpoints / RUN_ID).read_text() == STORED_ID
        assert sorted(path.name for path in checkpoints.iterdir()) == [RUN_ID], "a node left its own file behind"
