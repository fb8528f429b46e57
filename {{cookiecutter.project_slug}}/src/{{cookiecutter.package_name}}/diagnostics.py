"""What each process tells the log: where it sits in the job, and why a distributed job failed."""

import logging
import re
import socket
from datetime import timedelta

from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.distributed import DistError

from .cluster import NodeLevelEnvironment

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
    """When the job fails because a process is missing or lost, end the traceback with what happened."""

    def __init__(self, timeout: timedelta) -> None:
        self.timeout = timeout

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        message = str(exception).lower()
        if not (isinstance(exception, DistError) or "gloo" in message or "nccl" in message):
            return
        # The job is over: stop this node's other processes now rather than after their own
        # timeouts, so that this explanation is the node's last word.
        for process in getattr(trainer.strategy.launcher, "procs", []):
            process.kill()
            process.wait()
        exception.add_note(explain(exception, trainer, self.timeout))


def explain(exception: BaseException, trainer: Trainer, timeout: timedelta) -> str:
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
    lost = (peer and node_at(peer.group(1), environment)) or "another node"
    return (
        f"error: node {trainer.node_rank} (global rank {trainer.global_rank}) lost contact with the other processes"
        f" of the job ({type(exception).__name__}); {lost} probably died or was stopped: see its log."
    )


def node_at(address: str, environment: ClusterEnvironment | None) -> str | None:
    """The node whose documented host name resolves to `address`, when exactly one does."""
    if not isinstance(environment, NodeLevelEnvironment):
        return None
    matches = []
    for rank in range(environment.num_nodes):
        host = environment.host(rank)
        try:
            addresses = {info[4][0] for info in socket.getaddrinfo(host, None)} if host else set()
        except socket.gaierror:
            continue
        if address in addresses:
            matches.append(f"node {rank} ({host})")
    return matches[0] if len(matches) == 1 else None
