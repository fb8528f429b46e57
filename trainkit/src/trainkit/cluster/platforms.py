"""Which launch this process belongs to: SING, POD, or one of Lightning's own environments.

Which launch a process belongs to, first match wins (`detect_platform`):

0. A ClusterEnvironment of the project's own, named in `cluster.environments`, whose `detect()` says
   the process runs on its platform.
1. A launcher that starts every process itself: torchrun (TorchElastic's variables), then Slurm's
   srun. It wins over a node-level platform it runs in, as in Lightning ("TorchElastic has the
   highest priority since it can also be used inside SLURM"): torchrun in a SING container forms
   one job of all its processes. A launcher whose node count differs from the platform's
   (`torchrun --standalone` on a 2-node SING job) is refused, naming the torchrun flags that fit.
2. A node-level platform: SING (SING_RANK, SING_WORLD_SIZE), or POD (RANK and WORLD_SIZE in a
   process that no launcher started; Kubeflow's PyTorchJob and Volcano set the same). The
   variables of both at once are refused.
3. Lightning's manual launch: NODE_RANK (no RANK), WORLD_SIZE, MASTER_ADDR and MASTER_PORT on each
   node; Lightning's own LightningEnvironment runs it. WORLD_SIZE is read as Lightning's docs read it:
   the number of processes, with `trainer.num_nodes` giving the nodes; or, without `trainer.num_nodes`,
   as the number of nodes (the older reading).
4. Otherwise a single node, or LSF's or an MPI launcher's processes, which Lightning's own
   environments run. Lightning probes MPI only where an MPI launcher's variables are set: its probe
   starts MPI in the process, which aborts it on a machine with mpi4py (most NVIDIA images) that
   no `mpirun` launched.

Debug a launch without training: `python -m trainkit.cluster`.
"""

import importlib
import os
import re
from dataclasses import dataclass

from lightning.fabric.plugins.environments import ClusterEnvironment, LightningEnvironment

from trainkit.cluster.launch_variables import (
    ClusterConfigError,
    require,
    require_int,
    require_port,
)
from trainkit.cluster.launchers import started_by_srun, started_by_torchrun
from trainkit.cluster.node_level import NodeLevelEnvironment
from trainkit.cluster.pod import PODEnvironment
from trainkit.cluster.settings import ClusterSettings
from trainkit.cluster.sing import SINGEnvironment


@dataclass(frozen=True)
class Platform:
    """Where this process runs, as far as the environment variables tell."""

    name: str
    # None: Lightning picks its own environment (torchrun, Slurm, LSF, MPI).
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


def detect_platform(settings: ClusterSettings | None = None, trainer_num_nodes: int = 1) -> Platform:
    """Which launch this process belongs to, by the precedence in this module's docstring."""
    settings = settings or ClusterSettings()
    for class_path in settings.environments:
        named = _environment_class(class_path)
        if named.detect():
            return platform_of(_build(named, settings))
    if started_by_torchrun():
        platform = Platform(
            "torchrun",
            num_nodes=require_int("GROUP_WORLD_SIZE"),
            num_nodes_variable="GROUP_WORLD_SIZE",
            processes_per_node=require_int("LOCAL_WORLD_SIZE"),
            processes_per_node_variable="LOCAL_WORLD_SIZE",
        )
        _refuse_a_launcher_on_fewer_nodes_than_sing(platform, settings.main_port)
        return platform
    if started_by_srun():
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
        return platform_of(SINGEnvironment(settings.main_port, settings.address_timeout, settings.join_timeout))
    if PODEnvironment.detect():
        return platform_of(PODEnvironment(settings.main_port, settings.address_timeout, settings.join_timeout))
    if "NODE_RANK" in os.environ and (MANUAL_NUM_NODES in os.environ or not started_by_lightning):
        return _lightnings_manual_launch(trainer_num_nodes)
    if "WORLD_SIZE" in os.environ and not started_by_lightning:
        raise ClusterConfigError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} is set without RANK (the POD platform's pod index)"
            " or NODE_RANK (Lightning's manual launch): set the one your platform gives"
        )
    if any(name in os.environ for name in LSF_OR_MPI_VARIABLES):
        return Platform("LSF or MPI")
    return Platform("local", LightningEnvironment())


def _environment_class(class_path: str) -> type[ClusterEnvironment]:
    module, _, name = class_path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ClusterConfigError(f"cluster.environments: cannot import {class_path} ({error})") from None
    if not (isinstance(found, type) and issubclass(found, ClusterEnvironment)):
        raise ClusterConfigError(f"cluster.environments: {class_path} is not a ClusterEnvironment")
    return found


def _build(environment: type[ClusterEnvironment], settings: ClusterSettings) -> ClusterEnvironment:
    """A platform that starts one process per node gets the cluster settings, as SING and POD do."""
    if issubclass(environment, NodeLevelEnvironment):
        return environment(settings.main_port, settings.address_timeout, settings.join_timeout)
    return environment()


# What LSF's job starter and MPI launchers (Open MPI, MPICH and Intel MPI, PMIx, MVAPICH) set in each process.
LSF_OR_MPI_VARIABLES = ("LSB_JOBID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE")


# Where the first process of a node keeps the node count of a manual launch: Lightning rewrites
# WORLD_SIZE to the number of processes before it starts the node's other processes.
MANUAL_NUM_NODES = "MANUAL_LAUNCH_NUM_NODES"


def _lightnings_manual_launch(trainer_num_nodes: int) -> Platform:
    """Lightning's launch on a general-purpose cluster: NODE_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT."""
    if MANUAL_NUM_NODES not in os.environ:
        num_nodes = _manual_num_nodes(require_int("WORLD_SIZE"), trainer_num_nodes)
        node_rank = require_int("NODE_RANK")
        if not 0 <= node_rank < num_nodes:
            raise ClusterConfigError(f"NODE_RANK={node_rank} is outside 0..{num_nodes - 1} ({num_nodes} nodes)")
        if num_nodes > 1:
            require("MASTER_ADDR")  # on every node: LightningEnvironment would fall back to 127.0.0.1
        os.environ[MANUAL_NUM_NODES] = str(num_nodes)
    if "MASTER_PORT" in os.environ:
        require_port("MASTER_PORT")
    return Platform(
        "Lightning", LightningEnvironment(), num_nodes=require_int(MANUAL_NUM_NODES), num_nodes_variable="WORLD_SIZE"
    )


def _manual_num_nodes(world_size: int, trainer_num_nodes: int) -> int:
    """The nodes of a manual launch: `trainer.num_nodes` where given, WORLD_SIZE then counting their processes
    (Lightning's docs); else WORLD_SIZE, the nodes (the older reading)."""
    if world_size < 1:
        raise ClusterConfigError(f"WORLD_SIZE={world_size} must be at least 1")
    if trainer_num_nodes == 1:
        return world_size
    if world_size % trainer_num_nodes:
        raise ClusterConfigError(
            f"WORLD_SIZE={world_size} is neither the number of nodes (trainer.num_nodes={trainer_num_nodes}) nor"
            f" the processes of {trainer_num_nodes} nodes (a multiple of it)"
        )
    return trainer_num_nodes


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
