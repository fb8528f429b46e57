"""Nodes that share the run directory start at the same moment, each in a container of its own.

A container is a PID namespace of its own, so every node's first process has the same pid: a file
name made from the pid is the same file on every node. Threads of one process have one pid too, so
here each node is a thread, and all of them write the run's wandb id into one directory at once,
round after round, switching between threads as often as Python lets them. Containers that share the
host's network (`--network host`) share its host name too, so neither can tell two nodes apart.
"""

import sys
import threading
from collections.abc import Callable

import pytest
from jsonargparse import Namespace

from trainkit.checkpoints.stored import RUN_ID, keep_run_id_in_store
from trainkit.store.object_store import open_store
from trainkit.tracking.wandb_logger import keep_wandb_run_id

NODES = 8
ROUNDS = 200
STORED_ID = "0badc0de"  # the id an earlier job's store keeps: every node then replaces its own


@pytest.fixture
def switching_often():
    """Threads switch every microsecond rather than every 5 ms: the nodes' steps interleave."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(interval)


def every_node_at_once(step: Callable[[int], None]) -> list[BaseException]:
    """NODES threads run `step(round)` for every round, all starting each round together; what they raised."""
    together = threading.Barrier(NODES)
    failures: list[BaseException] = []

    def node() -> None:
        for round in range(ROUNDS):
            together.wait()
            try:
                step(round)
            except Exception as error:
                failures.append(error)

    nodes = [threading.Thread(target=node) for _ in range(NODES)]
    for thread in nodes:
        thread.start()
    for thread in nodes:
        thread.join()
    return failures


def test_nodes_whose_processes_have_the_same_pid_agree_on_the_runs_wandb_id(tmp_path, switching_often):
    for round in range(ROUNDS):
        open_store(f"file://{tmp_path}/store-{round}", 10).write(RUN_ID, STORED_ID.encode(), replacing=None)
    kept: dict[int, set[str]] = {round: set() for round in range(ROUNDS)}

    def start_logging(round: int) -> None:
        checkpoints = tmp_path / f"round-{round}" / "checkpoints"
        keep_wandb_run_id(Namespace(init_args=Namespace(id=None)), checkpoints)
        kept[round].add(keep_run_id_in_store(open_store(f"file://{tmp_path}/store-{round}", 10), checkpoints))

    failures = every_node_at_once(start_logging)
    assert not failures, failures[:3]
    assert all(ids == {STORED_ID} for ids in kept.values()), kept  # every node logs to the run the store keeps
    for round in range(ROUNDS):
        checkpoints = tmp_path / f"round-{round}" / "checkpoints"
        assert (checkpoints / RUN_ID).read_text() == STORED_ID
        assert [path.name for path in checkpoints.iterdir()] == [RUN_ID], "a node left its own file behind"


def test_nodes_whose_processes_have_the_same_host_and_pid_check_the_checkpoint_store_at_once(tmp_path, switching_often):
    store = open_store(f"file://{tmp_path}/store", 10)
    failures = every_node_at_once(lambda round: store.check(writable=True))  # each process, before training
    assert not failures, failures[:3]
    assert not list((tmp_path / "store").iterdir()), "a node left its probe behind"
