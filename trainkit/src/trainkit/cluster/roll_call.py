"""Before the job forms, each node says who it is, so that nodes that disagree are named as such.

SING and POD start every node on its own: two nodes given the same rank, or started with
different numbers of processes, would otherwise wait for each other until the timeout and fail as
"a node did not arrive". Each node's first process answers a roll call in the key-value store of
the main node (the one torch's process group uses next, on the same port) and waits until every
node has answered, or one refused. A node that ends on the roll call's verdict says it has heard it,
and node 0, whose process serves the store, waits for that briefly before it ends: the others read
why the job cannot form, rather than lose the main node mid-question.
"""

import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from datetime import timedelta

from torch.distributed import DistError, DistNetworkError, TCPStore

from trainkit.cluster.launch_variables import ClusterConfigError
from trainkit.cluster.store_client import NotAStore, connect_to_store
from trainkit.cluster.waiting import Reminder, log
from trainkit.run.job_store import wait_until

POLL_SECONDS = 0.2
# A node 0 that finds its port taken asks whether another node 0 of this job serves the store there.
TAKEN_PORT_ANSWERS_WITHIN = timedelta(seconds=5)
# Node 0 keeps the store open at most this long for the others to read the verdict.
VERDICT_HEARD_WITHIN = timedelta(seconds=10)
PRESENT, HEARD = "roll-call/present", "roll-call/heard"


class NodesDidNotArrive(RuntimeError):
    """Not every node answered the roll call in time: a node that is late, lost or cannot reach the main node."""


class MainPortTaken(NodesDidNotArrive):
    """Node 0 cannot serve the job's store: another process on its host holds the port, so the job cannot form."""

    def __init__(self, port: int) -> None:
        super().__init__(
            f"the main node cannot listen on port {port}: another process on this host holds it, so the other"
            " processes cannot join; give the job a free port (MASTER_PORT, or cluster.main_port where the platform"
            " sets none)"
        )


@dataclass(frozen=True)
class Answer:
    """What a node says of itself."""

    host: str
    pid: int
    processes: int

    def where(self) -> str:
        return f"host {self.host}, pid {self.pid}"


def roll_call(
    address: str, port: int, node_rank: int, num_nodes: int, processes: int, rank_variable: str, timeout: timedelta
) -> TCPStore:
    """Answer for this node and wait for the others; the store, which node 0 must keep open for torch to reuse."""
    main = node_rank == 0
    store = _open_store(address, port, is_main=main, timeout=timeout)
    store.add(PRESENT, 1)
    with _every_node_hears_the_verdict(store, serves=main):
        here = Answer(socket.gethostname(), os.getpid(), processes)
        answered = store.compare_set(_key(node_rank), "", json.dumps(asdict(here))).decode()
        if answered != json.dumps(asdict(here)):
            refusal = (
                f"two nodes claim node rank {node_rank}: {here.where()} and {Answer(**json.loads(answered)).where()};"
                f" give each node its own {rank_variable} (0..{num_nodes - 1})"
            )
            store.set("roll-call/refused", refusal)
            raise ClusterConfigError(refusal)
        answers = _wait_for_every_node(store, num_nodes, address, port, timeout)
        counts = {answer.processes for answer in answers}
        if len(counts) > 1:
            each = ", ".join(f"node {rank} ({answer.host}) {answer.processes}" for rank, answer in enumerate(answers))
            raise ClusterConfigError(
                f"the nodes start different numbers of processes ({each}): every node must start the same number;"
                " set trainer.devices alike on every node"
            )
    return store


@contextmanager
def _every_node_hears_the_verdict(store: TCPStore, serves: bool) -> Iterator[None]:
    """On the roll call's ClusterConfigError, this node says it heard the verdict before it ends; the node serving
    the store first waits until every node present has said so (or VERDICT_HEARD_WITHIN has passed)."""
    try:
        yield
    except ClusterConfigError:
        with suppress(DistError):  # a node whose main node has gone already has nothing left to tell
            store.add(HEARD, 1)
            if serves:
                wait_until(lambda: store.add(HEARD, 0) >= store.add(PRESENT, 0), VERDICT_HEARD_WITHIN.total_seconds())
        raise


def _open_store(address: str, port: int, is_main: bool, timeout: timedelta) -> TCPStore:
    """Node 0 serves the store (torch's process group reuses it: multi-tenant); the others connect to it."""
    if not is_main:
        return join_main_store(address, port, timeout)
    try:
        return TCPStore(address, port, is_master=True, multi_tenant=True, timeout=timeout, wait_for_workers=False)
    except DistNetworkError:
        pass  # the port is taken on this host: maybe by another node 0 of this job, which the roll call will name
    try:
        # That one serves the store already, and answers at once.
        return connect_to_store(address, port, TAKEN_PORT_ANSWERS_WITHIN)
    except (DistNetworkError, NotAStore):
        raise MainPortTaken(port) from None


def join_main_store(address: str, port: int, timeout: timedelta) -> TCPStore:
    """A client of the store node 0 serves; NodesDidNotArrive, saying why, when none answers within `timeout`."""
    try:
        return connect_to_store(address, port, timeout)
    except DistNetworkError:
        raise NodesDidNotArrive(
            f"could not reach the main node at {address}:{port} within {timeout} (cluster.join_timeout): node 0 did"
            " not arrive, or this node cannot reach that address"
        ) from None
    except NotAStore as error:
        raise NodesDidNotArrive(
            f"the main node's {error}, not node 0; give the job a free port (MASTER_PORT, or cluster.main_port where"
            " the platform sets none)"
        ) from None


def _wait_for_every_node(store: TCPStore, num_nodes: int, address: str, port: int, timeout: timedelta) -> list[Answer]:
    deadline = time.monotonic() + timeout.total_seconds()
    keys = [_key(rank) for rank in range(num_nodes)]
    reminder = Reminder()
    while not store.check(keys):
        if store.check(["roll-call/refused"]):
            raise ClusterConfigError(store.get("roll-call/refused").decode())
        if reminder.due():
            log.info(f"waiting for node {', '.join(_missing(store, keys))} to join at {address}:{port}; giving up"
                     f" after {timeout} (cluster.join_timeout)")  # fmt: skip
        if time.monotonic() > deadline:
            missing = _missing(store, keys)
            raise NodesDidNotArrive(
                f"only {num_nodes - len(missing)} of {num_nodes} nodes joined at {address}:{port} within {timeout}"
                f" (cluster.join_timeout): node {', '.join(missing)} did not arrive. Check that every node was started"
                " and can reach that address."
            )
        time.sleep(POLL_SECONDS)
    return [Answer(**json.loads(store.get(key))) for key in keys]


def _missing(store: TCPStore, keys: list[str]) -> list[str]:
    """The node ranks whose answer is not in the store."""
    return [str(rank) for rank, key in enumerate(keys) if not store.check([key])]


def _key(node_rank: int) -> str:
    return f"roll-call/node-{node_rank}"
