"""The SING cloud's ClusterEnvironment."""

import os

from trainkit.cluster.launch_variables import ClusterConfigError, require, require_rank_and_size
from trainkit.cluster.launchers import started_by_a_launcher
from trainkit.cluster.node_level import NodeLevelEnvironment


class SINGEnvironment(NodeLevelEnvironment):
    """The SING cloud: one container per node with SING_RANK, SING_WORLD_SIZE and SING_MASTER_ADDR.

    A node's host is `${SING_JOB_NAME}-${SING_RANK}.${SING_HOSTNAME_SUFFIX}`.
    """

    platform = "SING"
    node_rank_variable = "SING_RANK"
    node_count_variable = "SING_WORLD_SIZE"

    @staticmethod
    def detect() -> bool:
        """A SING node's process, or one Lightning started in it; not one that torchrun or srun started there."""
        return ("SING_RANK" in os.environ or "SING_WORLD_SIZE" in os.environ) and not started_by_a_launcher()

    def _read_node_rank_and_count(self) -> tuple[int, int]:
        return require_rank_and_size("SING_RANK", "SING_WORLD_SIZE")

    def _read_main_address(self) -> str:
        if "SING_MASTER_ADDR" in os.environ:
            return require("SING_MASTER_ADDR")
        if self.host(0) is None:
            raise ClusterConfigError("SING_MASTER_ADDR is not set, nor SING_JOB_NAME and SING_HOSTNAME_SUFFIX")
        return self.host(0)

    def host(self, node_rank: int) -> str | None:
        job, suffix = os.environ.get("SING_JOB_NAME"), os.environ.get("SING_HOSTNAME_SUFFIX")
        return f"{job}-{node_rank}.{suffix}" if job and suffix else None
