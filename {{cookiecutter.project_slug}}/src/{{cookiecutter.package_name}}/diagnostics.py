"""What each process tells the log: where it sits in the job, and why a distributed job failed."""

import logging
import re
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.distributed import DistError

log = logging.getLogger(__name__)


class LogProcessPlacement(Callback):
    """Each process logs one line once the job has formed, to make launch logs easy to check."""

    def __init__(self, platform: str) -> None:
        self.platform = platform

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        environment = getattr(trainer.strategy, "cluster_environment", None)
        main = f"{environment.main_address}:{environment.main_port}" if environment else "none"
        log.info(
            f"[{self.platform}] node_rank={trainer.node_rank} local_rank={trainer.local_rank} "
            f"global_rank={trainer.global_rank} world_size={trainer.world_size} main={main}"
        )


class ExplainDistributedFailure(Callback):
    """When the job fails because a process is missing or lost, end the traceback with what happened.

    Where every process runs (node, host name, addresses) is shared once the job has formed: after a
    node is lost, its name may no longer resolve (a stopped pod or container leaves DNS), and the
    error names only the address of the peer it lost.
    """

    def __init__(self, timeout: timedelta) -> None:
        self.timeout = timeout
        self.placement: list[Placement] = []

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            return
        here = Placement(trainer.node_rank, trainer.global_rank, socket.gethostname(), own_addresses())
        self.placement = [here] * trainer.world_size
        dist.all_gather_object(self.placement, here)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        message = str(exception).lower()
        if not (isinstance(exception, DistError) or "gloo" in message or "nccl" in message):
            return
        # The job is over: stop this node's other processes now rather than after their own
        # timeouts, so that this explanation is the node's last word.
        for process in getattr(trainer.strategy.launcher, "procs", []):
            process.kill()
            process.wait()
        exception.add_note(explain(exception, trainer, self.timeout, self.placement))


@dataclass(frozen=True)
class Placement:
    """Where one process of the job runs."""

    node_rank: int
    global_rank: int
    host: str
    addresses: tuple[str, ...]


def own_addresses() -> tuple[str, ...]:
    """The addresses this machine's host name resolves to: the ones its peers connect to."""
    try:
        return tuple(sorted({info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}))
    except socket.gaierror:
        return ()


def explain(exception: BaseException, trainer: Trainer, timeout: timedelta, placement: list[Placement]) -> str:
    """One line for the end of the log: which processes or nodes are missing, and where they were awaited."""
    environment = getattr(trainer.strategy, "cluster_environment", None)
    main = f"{environment.main_address}:{environment.main_port}" if environment else "the main node"
    per_node = trainer.num_devices
    joined = re.search(r"(\d+)/(\d+) clients joined", str(exception))
    if joined:
        arrived, expected = int(joined.group(1)), int(joined.group(2))
        missing_nodes = -(-(expected - arrived) // per_node)
        return (
            f"error: only {arrived} of {expected} processes joined at {main} within {timeout}:"
            f" {missing_nodes} of {expected // per_node} nodes did not arrive ({per_node} processes each)."
            " Check that every node was started and can reach that address."
        )
    if isinstance(exception, DistError) and trainer.global_rank != 0 and "connect" in str(exception).lower():
        return f"error: could not reach the main node at {main} within {timeout}; is node 0 running?"
    peer = re.search(r"peer \[([^\]]+)\]", str(exception))
    lost = (peer and node_at(peer.group(1), placement, trainer.global_rank)) or "another node"
    return (
        f"error: node {trainer.node_rank} (global rank {trainer.global_rank}) lost contact with the other processes"
        f" of the job ({type(exception).__name__}); {lost} probably died or was stopped: see its log."
    )


def node_at(address: str, placement: list[Placement], own_rank: int) -> str | None:
    """The node whose processes (other than this one) ran at `address`, when they were all on one node."""
    others = [process for process in placement if address in process.addresses and process.global_rank != own_rank]
    if len({process.node_rank for process in others}) != 1:
        return None
    ranks = ", ".join(str(process.global_rank) for process in others)
    return f"node {others[0].node_rank} (host {others[0].host}, global ranks {ranks})"
