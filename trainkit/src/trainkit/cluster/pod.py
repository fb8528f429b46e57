"""The POD platform's ClusterEnvironment (Kubernetes-like)."""

import os

from trainkit.cluster.launch_variables import ClusterConfigError, require, require_rank_and_size
from trainkit.cluster.launchers import started_by_a_launcher
from trainkit.cluster.node_level import NodeLevelEnvironment


class PODEnvironment(NodeLevelEnvironment):
    """The POD platform (Kubernetes-like): one pod per node with RANK, WORLD_SIZE and MASTER_ADDR.

    RANK and WORLD_SIZE are the pod's index and the number of pods. A pod's host is
    `${JOB_NAME}-${RANK}.${SVC_NAME}.${POD_NAMESPACE}.svc.cluster.local`.

    Lightning rewrites WORLD_SIZE to the number of processes before it starts a node's other
    processes, and this class sets RANK to each process's global rank, so the pod's own values
    are kept in POD_RANK and POD_WORLD_SIZE, where every process of the pod reads them.
    """

    platform = "POD"
    node_rank_variable = "RANK"
    node_count_variable = "WORLD_SIZE"

    @staticmethod
    def detect() -> bool:
        """A pod's own process (RANK, no LOCAL_RANK), or one Lightning started in a pod (POD_WORLD_SIZE); not one
        that torchrun or srun started, which set RANK and WORLD_SIZE too."""
        pod = "POD_WORLD_SIZE" in os.environ or ("RANK" in os.environ and "LOCAL_RANK" not in os.environ)
        return pod and not started_by_a_launcher()

    def _read_node_rank_and_count(self) -> tuple[int, int]:
        if "POD_WORLD_SIZE" in os.environ:
            return require_rank_and_size("POD_RANK", "POD_WORLD_SIZE")
        if "WORLD_SIZE" not in os.environ:
            raise ClusterConfigError(
                f"RANK={os.environ['RANK']} is set without WORLD_SIZE: a pod needs both (its index and the number"
                " of pods); on a single machine unset RANK"
            )
        rank, size = require_rank_and_size("RANK", "WORLD_SIZE")
        os.environ["POD_RANK"], os.environ["POD_WORLD_SIZE"] = str(rank), str(size)
        return rank, size

    def _read_main_address(self) -> str:
        if "MASTER_ADDR" in os.environ:
            return require("MASTER_ADDR")
        if self.host(0) is None:
            raise ClusterConfigError("MASTER_ADDR is not set, nor JOB_NAME, SVC_NAME and POD_NAMESPACE")
        return self.host(0)

    def host(self, node_rank: int) -> str | None:
        job, service, namespace = (os.environ.get(name) for name in ("JOB_NAME", "SVC_NAME", "POD_NAMESPACE"))
        if not (job and service and namespace):
            return None
        return f"{job}-{node_rank}.{service}.{namespace}.svc.cluster.local"
