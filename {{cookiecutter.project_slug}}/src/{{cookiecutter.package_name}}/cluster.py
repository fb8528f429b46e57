"""Tell Lightning where it runs: the SING cloud, the POD platform, or Lightning's own environments.

SING and POD start ONE process per node and give it node-level variables (node index, node
count, main address). Lightning then starts one more process per device on each node, so
`creates_processes_externally` is False in the node's first process and True in the ones
Lightning started. torchrun, Slurm, LSF and MPI are handled by Lightning's own environments,
used as they are.

Which launch a process belongs to, first match wins (`detect_platform`):

1. A launcher that starts every process itself: torchrun (TorchElastic's variables), then Slurm's
   srun. It wins over a node-level platform it runs in, as in Lightning ("TorchElastic has the
   highest priority since it can also be used inside SLURM"): torchrun in a SING container forms
   one job of all its processes. A launcher whose node count differs from the platform's
   (`torchrun --standalone` on a 2-node SING job) is refused, naming the torchrun flags that fit.
2. A node-level platform: SING (SING_RANK, SING_WORLD_SIZE), or POD (RANK and WORLD_SIZE in a
   process that no launcher started; Kubeflow's PyTorchJob and Volcano set the same). The
   variables of both at once are refused.
3. Lightning's manual launch: NODE_RANK (no RANK), WORLD_SIZE (the number of nodes), MASTER_ADDR
   and MASTER_PORT on each node; Lightning's own LightningEnvironment runs it.
4. Otherwise a single node.

Debug a launch without training: `python -m {{ cookiecutter.package_name }}.cluster`.
"""

import logging
import os
import re
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment, TorchElasticEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_only
from torch.distributed import TCPStore

from .exit_codes import CONFIG_ERROR
from .launch_variables import ClusterConfigError, require, require_int, require_port, require_rank_and_size
from .roll_call import roll_call

log = logging.getLogger(__name__)

DEFAULT_MAIN_PORT = {{ cookiecutter.main_port }}


@dataclass
class ClusterSettings:
    """The `cluster:` section of the config: how the processes of a job find each other.

    Args:
        main_port: port of the main node when the platform sets no MASTER_PORT; the same on every node.
        address_timeout: seconds to wait for the main node's host name to resolve (pods start at
            different times and a headless service's DNS lags behind).
        timeout: how long a process waits for the others, to join the job or in a collective,
            before the job fails instead of hanging (torch's own default is 30 minutes).
    """

    main_port: int = DEFAULT_MAIN_PORT
    address_timeout: float = 300.0
    timeout: timedelta = timedelta(minutes=5)


def wait_until_resolvable(host: str, timeout: float, interval: float = 2.0) -> None:
    """Return once `host` resolves; raise ClusterConfigError naming it after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.getaddrinfo(host, None)
            return
        except socket.gaierror as error:
            if time.monotonic() >= deadline:
                raise ClusterConfigError(
                    f"main address {host!r} did not resolve within {timeout:g} s ({error.strerror})"
                ) from None
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
        timeout: timedelta = ClusterSettings.timeout,
    ) -> None:
        super().__init__()
        self._node_rank, self._num_nodes = self._read_node_rank_and_count()
        self._main_address = self._read_main_address()
        if not 1 <= main_port <= 65535:
            raise ClusterConfigError(f"cluster.main_port={main_port} is not a port number (1-65535)")
        self._main_port = require_port("MASTER_PORT") if "MASTER_PORT" in os.environ else main_port
        self.address_timeout = address_timeout
        self.timeout = timeout
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
        # Runs in every process before Lightning starts a node's other processes.
        if num_nodes != self.num_nodes:
            raise ClusterConfigError(f"trainer.num_nodes={num_nodes} but {self.node_count_variable}={self.num_nodes}")
        if self.creates_processes_externally:
            return  # a process Lightning started: its node's first process has checked
        wait_until_resolvable(self.main_address, self.address_timeout)
        # Kept open until the process group forms: on node 0 it is the store torch then reuses.
        self._roll_call_store = roll_call(
            self.main_address, self.main_port, self._node_rank, self._num_nodes, num_devices,
            self.node_rank_variable, self.timeout,
        )  # fmt: skip


class SINGEnvironment(NodeLevelEnvironment):
    """The SING cloud: one container per node with SING_RANK, SING_WORLD_SIZE and SING_MASTER_ADDR.

    A node's host is `${SING_JOB_NAME}-${SING_RANK}.${SING_HOSTNAME_SUFFIX}`.
    """

    platform = "SING"
    node_rank_variable = "SING_RANK"
    node_count_variable = "SING_WORLD_SIZE"

    @staticmethod
    def detect() -> bool:
        return "SING_RANK" in os.environ or "SING_WORLD_SIZE" in os.environ

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
        """A pod's own process (RANK, no LOCAL_RANK), or one Lightning started in a pod (POD_WORLD_SIZE).

        Call it after the launchers that start every process (torchrun, Slurm) were ruled out.
        """
        return "POD_WORLD_SIZE" in os.environ or ("RANK" in os.environ and "LOCAL_RANK" not in os.environ)

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


@dataclass(frozen=True)
class Platform:
    """Where this process runs, as far as the environment variables tell."""

    name: str
    # None: Lightning picks its own environment (torchrun, Slurm, LSF, MPI, or a single node).
    environment: ClusterEnvironment | None = None
    # The platform's node count and the variable it came from; None when the platform gives none.
    num_nodes: int | None = None
    num_nodes_variable: str = ""
    # The processes the launcher started on this node (torchrun, Slurm) and the variable it came
    # from; None where Lightning starts them itself, one per device.
    processes_per_node: int | None = None
    processes_per_node_variable: str = ""


def platform_of(environment: ClusterEnvironment) -> Platform:
    if isinstance(environment, NodeLevelEnvironment):
        return Platform(environment.platform, environment, environment.num_nodes, environment.node_count_variable)
    return Platform(type(environment).__name__, environment)


def detect_platform(settings: ClusterSettings | None = None) -> Platform:
    """Which launch this process belongs to, by the precedence in this module's docstring."""
    settings = settings or ClusterSettings()
    if TorchElasticEnvironment.detect():
        platform = Platform(
            "torchrun",
            num_nodes=require_int("GROUP_WORLD_SIZE"),
            num_nodes_variable="GROUP_WORLD_SIZE",
            processes_per_node=require_int("LOCAL_WORLD_SIZE"),
            processes_per_node_variable="LOCAL_WORLD_SIZE",
        )
        _refuse_a_launcher_on_fewer_nodes_than_sing(platform, settings.main_port)
        return platform
    if SLURMEnvironment.detect():
        tasks_variable, tasks_per_node = _slurm_tasks_per_node()
        return Platform(
            "Slurm",
            num_nodes=require_int("SLURM_NNODES"),
            num_nodes_variable="SLURM_NNODES",
            processes_per_node=tasks_per_node,
            processes_per_node_variable=tasks_variable,
        )
    started_by_lightning = "LOCAL_RANK" in os.environ
    if SINGEnvironment.detect():
        if not started_by_lightning and "RANK" in os.environ:
            raise ClusterConfigError(
                "both SING variables (SING_RANK, SING_WORLD_SIZE) and POD variables (RANK, WORLD_SIZE) are set:"
                " unset the ones of the platform this job does not run on"
            )
        return platform_of(SINGEnvironment(settings.main_port, settings.address_timeout, settings.timeout))
    if PODEnvironment.detect():
        return platform_of(PODEnvironment(settings.main_port, settings.address_timeout, settings.timeout))
    if "NODE_RANK" in os.environ and (MANUAL_NUM_NODES in os.environ or not started_by_lightning):
        return _lightnings_manual_launch()
    if "WORLD_SIZE" in os.environ and not started_by_lightning:
        raise ClusterConfigError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} is set without RANK (the POD platform's pod index)"
            " or NODE_RANK (Lightning's manual launch): set the one your platform gives"
        )
    return Platform("local")


# Where the first process of a node keeps the node count of a manual launch: Lightning rewrites
# WORLD_SIZE to the number of processes before it starts the node's other processes.
MANUAL_NUM_NODES = "MANUAL_LAUNCH_NUM_NODES"


def _lightnings_manual_launch() -> Platform:
    """Lightning's launch on a general-purpose cluster: NODE_RANK, WORLD_SIZE nodes, MASTER_ADDR, MASTER_PORT."""
    if MANUAL_NUM_NODES not in os.environ:
        _, num_nodes = require_rank_and_size("NODE_RANK", "WORLD_SIZE")
        if num_nodes > 1:
            require("MASTER_ADDR")  # on every node: LightningEnvironment would fall back to 127.0.0.1
        os.environ[MANUAL_NUM_NODES] = str(num_nodes)
    if "MASTER_PORT" in os.environ:
        require_port("MASTER_PORT")
    return Platform("Lightning", num_nodes=require_int(MANUAL_NUM_NODES), num_nodes_variable="WORLD_SIZE")


def _refuse_a_launcher_on_fewer_nodes_than_sing(launcher: Platform, main_port: int) -> None:
    """torchrun inside a SING node must span the job's nodes, or each node trains a job of its own."""
    if "SING_WORLD_SIZE" not in os.environ:
        return
    sing_nodes = require_int("SING_WORLD_SIZE")
    if sing_nodes == launcher.num_nodes:
        return
    main_address = os.environ.get("SING_MASTER_ADDR", "$SING_MASTER_ADDR")
    raise ClusterConfigError(
        f"{launcher.name} runs {launcher.num_nodes} node(s) ({launcher.num_nodes_variable}={launcher.num_nodes})"
        f" but this SING job has {sing_nodes} (SING_WORLD_SIZE={sing_nodes}): start torchrun with"
        f" --nnodes {sing_nodes} --node-rank $SING_RANK --rdzv-backend c10d"
        f" --rdzv-endpoint {main_address}:{main_port} --rdzv-id $SING_JOB_NAME,"
        " or without torchrun (Lightning then starts one process per GPU)"
    )


def _slurm_tasks_per_node() -> tuple[str, int | None]:
    """Slurm's tasks per node: `--ntasks-per-node`, else the allocation's when every node has the same count."""
    if "SLURM_NTASKS_PER_NODE" in os.environ:
        return "SLURM_NTASKS_PER_NODE", require_int("SLURM_NTASKS_PER_NODE")
    # "4" or "4(x2)": 4 tasks on each node. "3,1" differs between nodes: no single count.
    uniform = re.fullmatch(r"(\d+)(\(x\d+\))?", os.environ.get("SLURM_TASKS_PER_NODE", ""))
    return "SLURM_TASKS_PER_NODE", int(uniform.group(1)) if uniform else None


def describe(platform: Platform) -> str:
    """One line for a launch log: the platform, this node, and where the main node is."""
    environment = platform.environment
    if not isinstance(environment, NodeLevelEnvironment):
        nodes = f"{platform.num_nodes} nodes" if platform.num_nodes else "node count set by trainer.num_nodes"
        return f"platform={platform.name} ({nodes}; Lightning's own environment)"
    own_host = environment.host(environment.node_rank()) or "unknown"
    return (
        f"platform={platform.name} node_rank={environment.node_rank()} num_nodes={environment.num_nodes} "
        f"host={own_host} main={environment.main_address}:{environment.main_port}"
    )


def main() -> None:
    try:
        print(describe(detect_platform()))
    except ClusterConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(CONFIG_ERROR)


if __name__ == "__main__":
    main()
