"""What SING and POD share: one process per node started by the platform, the rest by Lightning.

SING and POD start ONE process per node and give it node-level variables (node index, node
count, main address). Lightning then starts one more process per device on each node, so
`creates_processes_externally` is False in the node's first process and True in the ones
Lightning started.
"""

import os
import socket
import time
from datetime import timedelta

from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_only
from torch.distributed import TCPStore

from trainkit.cluster.launch_variables import ClusterConfigError, require_port
from trainkit.cluster.roll_call import roll_call
from trainkit.cluster.settings import DEFAULT_MAIN_PORT, ClusterSettings
from trainkit.cluster.waiting import Reminder, log


def wait_until_resolvable(host: str, timeout: float, interval: float = 2.0) -> None:
    """Return once `host` resolves; raise ClusterConfigError naming it after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    reminder = Reminder()
    while True:
        try:
            socket.getaddrinfo(host, None)
            return
        except socket.gaierror as error:
            if time.monotonic() >= deadline:
                raise ClusterConfigError(
                    f"main address {host!r} did not resolve within {timeout:g} s ({error.strerror})"
                ) from None
            if reminder.due():
                log.info(f"waiting for the main address {host!r} to resolve ({error.strerror}); giving up after"
                         f" {timeout:g} s (cluster.address_timeout)")  # fmt: skip
            time.sleep(interval)


class NodeLevelEnvironment(ClusterEnvironment):
    """A platform that starts one process per node and leaves the other devices to Lightning.

    Subclasses say where the node rank, node count and host names come from.
    """

    platform = ""
    node_rank_variable = ""
    node_count_variable = ""

    def __init__(
        self,
        main_port: int = DEFAULT_MAIN_PORT,
        address_timeout: float = 300.0,
        join_timeout: timedelta = ClusterSettings.join_timeout,
    ) -> None:
        super().__init__()
        self._node_rank, self._num_nodes = self._read_node_rank_and_count()
        self._main_address = self._read_main_address()
        if not 1 <= main_port <= 65535:
            raise ClusterConfigError(f"cluster.main_port={main_port} is not a port number (1-65535)")
        self._main_port = require_port("MASTER_PORT") if "MASTER_PORT" in os.environ else main_port
        self.address_timeout = address_timeout
        self.join_timeout = join_timeout
        self._roll_call_store: TCPStore | None = None
        self._global_rank = 0
        self._world_size = 1

    def _read_node_rank_and_count(self) -> tuple[int, int]:
        raise NotImplementedError

    def _read_main_address(self) -> str:
        raise NotImplementedError

    def host(self, node_rank: int) -> str | None:
        """The documented host name of a node, or None when the platform's variables do not give it."""
        raise NotImplementedError

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @property
    def creates_processes_externally(self) -> bool:
        # Lightning sets LOCAL_RANK in the processes it starts; the platform's process has none.
        return "LOCAL_RANK" in os.environ

    @property
    def main_address(self) -> str:
        return self._main_address

    @property
    def main_port(self) -> int:
        return self._main_port

    def node_rank(self) -> int:
        return self._node_rank

    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    def global_rank(self) -> int:
        return self._global_rank

    def set_global_rank(self, rank: int) -> None:
        self._global_rank = rank
        rank_zero_only.rank = rank
        # Code that reads RANK (loggers, user code) must see this process's rank, not the node's.
        os.environ["RANK"] = str(rank)

    def rank_before_launch(self) -> int | None:
        """This process's global rank as far as it is known before the Trainer counts the devices.

        Node 0's first process is rank 0. The processes Lightning started know theirs from the
        variables it set (WORLD_SIZE is then the number of processes). The first process of
        another node learns its rank only once the Trainer knows how many devices each node has.
        """
        if "LOCAL_RANK" not in os.environ:
            return 0 if self._node_rank == 0 else None
        processes_per_node = int(os.environ["WORLD_SIZE"]) // self._num_nodes
        return self._node_rank * processes_per_node + self.local_rank()

    def use_rank_before_launch(self) -> None:
        """Make log lines rank-correct from the start: rank-zero-only output, and the `[rank: N]` prefixes.

        At import, Lightning takes its rank from RANK or LOCAL_RANK, which on these platforms are
        the node's index (POD) or the local rank (processes Lightning started), not the global rank.
        """
        rank = self.rank_before_launch()
        if rank is not None:
            self.set_global_rank(rank)
            return
        # Not rank 0, but which rank is not known yet: print none rather than a wrong one.
        os.environ.pop("RANK", None)
        rank_zero_only.rank = self._node_rank

    def world_size(self) -> int:
        return self._world_size

    def set_world_size(self, size: int) -> None:
        self._world_size = size

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        # Lightning's check of the numbers, in every process; it touches no network (see `call_the_roll`).
        if num_nodes != self.num_nodes:
            raise ClusterConfigError(f"trainer.num_nodes={num_nodes} but {self.node_count_variable}={self.num_nodes}")

    def call_the_roll(self, num_devices: int) -> None:
        """Wait until the main node's name resolves, then check in with every node (cluster/roll_call.py), so that
        a node that is missing or counts other devices is named before training. Called by the node's first
        process once the Trainer is built, before Lightning starts the node's other processes."""
        if self.creates_processes_externally:
            return  # a process Lightning started: its node's first process has answered
        wait_until_resolvable(self.main_address, self.address_timeout)
        # Kept open until the process group forms: on node 0 it is the store torch then reuses.
        self._roll_call_store = roll_call(
            self.main_address, self.main_port, self._node_rank, self._num_nodes, num_devices,
            self.node_rank_variable, self.join_timeout,
        )  # fmt: skip
