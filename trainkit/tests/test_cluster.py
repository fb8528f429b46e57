"""The SING and POD environments and platform detection, over the platforms' documented examples."""

import logging
import os
import re
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment, TorchElasticEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_only

from trainkit.cluster import waiting
from trainkit.cluster.arrival import wait_for_every_process
from trainkit.cluster.launch_variables import ClusterConfigError
from trainkit.cluster.node_level import wait_until_resolvable
from trainkit.cluster.platforms import MANUAL_NUM_NODES, describe, detect_platform
from trainkit.cluster.pod import PODEnvironment
from trainkit.cluster.process_counts import devices_per_node, num_nodes
from trainkit.cluster.roll_call import MainPortTaken, NodesDidNotArrive, roll_call
from trainkit.cluster.settings import DEFAULT_MAIN_PORT, ClusterSettings
from trainkit.cluster.sing import SINGEnvironment

from .helpers import clean_env, free_port, quick_run_args, run_train

# The documents' example: job `test` with 2 nodes, as node 1 sees it.
SING_NODE_1 = {
    "SING_RANK": "1",
    "SING_WORLD_SIZE": "2",
    "SING_JOB_NAME": "test",
    "SING_HOSTNAME_SUFFIX": "test-service.demo-project.svc.cluster.local",
    "SING_MASTER_ADDR": "test-0.test-service.demo-project.svc.cluster.local",
}
POD_NODE_1 = {
    "RANK": "1",
    "WORLD_SIZE": "2",
    "JOB_NAME": "test",
    "SVC_NAME": "test-service",
    "POD_NAMESPACE": "demo-project",
    "MASTER_ADDR": "test-0.test-service.demo-project.svc.cluster.local",
}
TORCHRUN = {
    "RANK": "3", "LOCAL_RANK": "1", "GROUP_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
    "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "job",
}  # fmt: skip
SLURM = {"SLURM_NTASKS": "4", "SLURM_NNODES": "2", "SLURM_JOB_NAME": "train", "SLURM_NODEID": "1", "SLURM_PROCID": "3"}


@pytest.fixture
def environ(monkeypatch):
    """Replace os.environ by a clean copy for one test; returns a function that sets variables."""
    monkeypatch.setattr(os, "environ", clean_env())
    # set_global_rank also sets Lightning's process-wide rank, which silences loggers in later tests.
    monkeypatch.setattr(rank_zero_only, "rank", rank_zero_only.rank)

    def set_variables(variables: dict[str, str]) -> None:
        os.environ.update(variables)

    return set_variables


def test_sing_node_from_documented_variables(environ):
    environ(SING_NODE_1)
    env = SINGEnvironment()
    assert (env.node_rank(), env.num_nodes) == (1, 2)
    assert env.main_address == "test-0.test-service.demo-project.svc.cluster.local"
    assert env.main_port == DEFAULT_MAIN_PORT
    assert env.host(1) == "test-1.test-service.demo-project.svc.cluster.local"
    assert not env.creates_processes_externally


def test_sing_main_address_built_from_host_pattern(environ):
    environ({name: value for name, value in SING_NODE_1.items() if name != "SING_MASTER_ADDR"})
    assert SINGEnvironment().main_address == "test-0.test-service.demo-project.svc.cluster.local"


def test_pod_node_from_documented_variables(environ):
    environ(POD_NODE_1)
    env = PODEnvironment()
    assert (env.node_rank(), env.num_nodes) == (1, 2)
    assert env.main_address == "test-0.test-service.demo-project.svc.cluster.local"
    assert env.host(1) == "test-1.test-service.demo-project.svc.cluster.local"


def test_pod_main_address_built_from_host_pattern(environ):
    environ({name: value for name, value in POD_NODE_1.items() if name != "MASTER_ADDR"})
    assert PODEnvironment().main_address == "test-0.test-service.demo-project.svc.cluster.local"


def test_main_port_from_master_port_else_configured_default(environ):
    environ(POD_NODE_1)
    assert PODEnvironment(main_port=23456).main_port == 23456
    os.environ["MASTER_PORT"] = "31000"
    assert PODEnvironment(main_port=23456).main_port == 31000


def test_pod_processes_started_by_lightning_keep_the_pod_values(environ):
    """Lightning rewrites WORLD_SIZE and sets LOCAL_RANK before starting a node's other processes."""
    environ(POD_NODE_1)
    first = PODEnvironment()
    first.set_global_rank(2)
    assert os.environ["RANK"] == "2"  # user code sees the global rank, not the pod index
    os.environ.update(WORLD_SIZE="8", LOCAL_RANK="1", NODE_RANK="1")  # what the launcher does
    assert PODEnvironment.detect() and not TorchElasticEnvironment.detect()
    spawned = PODEnvironment()
    assert (spawned.node_rank(), spawned.num_nodes) == (1, 2)
    assert spawned.creates_processes_externally and spawned.local_rank() == 1


def test_sing_processes_started_by_lightning_keep_the_node_values(environ):
    environ(SING_NODE_1)
    os.environ.update(WORLD_SIZE="8", LOCAL_RANK="3", NODE_RANK="1", MASTER_ADDR="10.1.1.1")
    env = SINGEnvironment()
    assert (env.node_rank(), env.num_nodes, env.local_rank()) == (1, 2, 3)
    assert env.creates_processes_externally


# Every documented launch, as one process of it sees its environment: the platform chosen, the
# environment Lightning then runs with, the node's rank, the node count, and the processes per node
# the launcher started (None: Lightning starts one per device).
KUBEFLOW_TRAINER_V2 = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "1",
                       "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29400"}  # fmt: skip
LAUNCHES = {
    "SING node (documents' example)": (SING_NODE_1, "SING", SINGEnvironment, 1, 2, None),
    "SING node 0, main address from the host pattern": (
        {**{k: v for k, v in SING_NODE_1.items() if k != "SING_MASTER_ADDR"}, "SING_RANK": "0"},
        "SING", SINGEnvironment, 0, 2, None,
    ),
    "SING, a process Lightning started": (
        {**SING_NODE_1, "LOCAL_RANK": "1", "NODE_RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1",
         "MASTER_PORT": "29500"},
        "SING", SINGEnvironment, 1, 2, None,
    ),
    "POD pod (documents' example)": (POD_NODE_1, "POD", PODEnvironment, 1, 2, None),
    "POD, a process Lightning started": (
        {**POD_NODE_1, "POD_RANK": "1", "POD_WORLD_SIZE": "2", "RANK": "3", "LOCAL_RANK": "1", "NODE_RANK": "1",
         "WORLD_SIZE": "4", "MASTER_PORT": "29500"},
        "POD", PODEnvironment, 1, 2, None,
    ),
    "Volcano's PyTorch plugin / Kubeflow PyTorchJob pod": (
        {"MASTER_ADDR": "job-master-0.job", "MASTER_PORT": "23456", "WORLD_SIZE": "3", "RANK": "2"},
        "POD", PODEnvironment, 2, 3, None,
    ),
    "torchrun --standalone": (
        {"RANK": "1", "LOCAL_RANK": "1", "GROUP_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
         "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x"},
        "torchrun", TorchElasticEnvironment, 0, 1, 2,
    ),
    "torchrun, 2 nodes (also Docker Swarm)": (TORCHRUN, "torchrun", TorchElasticEnvironment, 1, 2, 2),
    "torchrun inside a SING node, spanning the job": (
        {**SING_NODE_1, **TORCHRUN}, "torchrun", TorchElasticEnvironment, 1, 2, 2,
    ),
    "torchrun inside a POD pod": (
        {**TORCHRUN, "JOB_NAME": "test", "SVC_NAME": "svc", "POD_NAMESPACE": "ns"},
        "torchrun", TorchElasticEnvironment, 1, 2, 2,
    ),
    "Kubeflow Trainer v2 (PET_* through torchrun)": (
        {**KUBEFLOW_TRAINER_V2, **TORCHRUN}, "torchrun", TorchElasticEnvironment, 1, 2, 2,
    ),
    "Slurm srun task": (
        {**SLURM, "SLURM_NTASKS_PER_NODE": "2", "SLURM_LOCALID": "1"}, "Slurm", SLURMEnvironment, 1, 2, 2,
    ),
    "Lightning's manual launch (cluster_intermediate_1)": (
        {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "2", "NODE_RANK": "1"},
        "Lightning", LightningEnvironment, 1, 2, None,
    ),
    "Lightning's manual launch, a process Lightning started": (
        {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "4", "NODE_RANK": "1", "LOCAL_RANK": "1",
         MANUAL_NUM_NODES: "2"},
        "Lightning", LightningEnvironment, 1, 2, None,
    ),
    "one machine, a process Lightning started": (
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "41000", "WORLD_SIZE": "2", "NODE_RANK": "0", "LOCAL_RANK": "1"},
        "local", LightningEnvironment, 0, None, None,
    ),
    "one machine": ({}, "local", LightningEnvironment, 0, None, None),
}  # fmt: skip


@pytest.mark.parametrize(
    ("variables", "name", "environment_class", "node_rank", "nodes", "per_node"), LAUNCHES.values(), ids=LAUNCHES
)
def test_every_documented_launch_lands_on_the_right_environment(
    environ, variables, name, environment_class, node_rank, nodes, per_node
):
    environ(variables)
    platform = detect_platform()
    assert (platform.name, platform.num_nodes, platform.processes_per_node) == (name, nodes, per_node)
    if platform.environment is None:  # Lightning picks its own: the first of its environments that detects
        for earlier in (TorchElasticEnvironment, SLURMEnvironment):
            if earlier is environment_class:
                break
            assert not earlier.detect()
        environment = environment_class()
    else:
        environment = platform.environment
    assert type(environment) is environment_class
    assert environment.node_rank() == node_rank
    if per_node is not None:  # the launcher also gives the world size
        assert environment.world_size() == nodes * per_node


REFUSED_LAUNCHES = {
    "SING and POD variables together": (
        {**SING_NODE_1, "RANK": "1", "WORLD_SIZE": "2"}, "both SING variables .* and POD variables .* are set",
    ),
    "torchrun --standalone on a 2-node SING job": (
        {**SING_NODE_1, "RANK": "1", "LOCAL_RANK": "1", "GROUP_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
         "GROUP_WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "x"},
        r"torchrun runs 1 node\(s\) \(GROUP_WORLD_SIZE=1\) but this SING job has 2 \(SING_WORLD_SIZE=2\): start"
        r" torchrun with --nnodes 2 --node-rank \$SING_RANK --rdzv-backend c10d --rdzv-endpoint"
        r" test-0.test-service.demo-project.svc.cluster.local:\d+",
    ),
    "RANK without WORLD_SIZE": ({"RANK": "1"}, "RANK=1 is set without WORLD_SIZE"),
    "WORLD_SIZE without RANK or NODE_RANK": ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set without RANK .* or NODE_RANK"),
    "POD RANK empty": ({**POD_NODE_1, "RANK": ""}, "RANK is set but empty"),
    "MASTER_PORT above 65535": ({**POD_NODE_1, "MASTER_PORT": "70000"}, r"MASTER_PORT=70000 is not a port number"),
    "MASTER_PORT 0": ({**POD_NODE_1, "MASTER_PORT": "0"}, r"MASTER_PORT=0 is not a port number"),
    "manual launch, NODE_RANK out of range": (
        {"MASTER_ADDR": "h", "MASTER_PORT": "1", "WORLD_SIZE": "2", "NODE_RANK": "2"}, r"NODE_RANK=2 is outside 0..1",
    ),
    "manual launch without MASTER_ADDR": (
        {"MASTER_PORT": "29500", "WORLD_SIZE": "2", "NODE_RANK": "1"}, "MASTER_ADDR is not set",
    ),
    "manual launch, MASTER_PORT not a number": (
        {"MASTER_ADDR": "h", "MASTER_PORT": "http", "WORLD_SIZE": "2", "NODE_RANK": "1"},
        "MASTER_PORT='http' is not an integer",
    ),
}  # fmt: skip


@pytest.mark.parametrize(("variables", "message"), REFUSED_LAUNCHES.values(), ids=REFUSED_LAUNCHES)
def test_launches_that_cannot_work_are_refused_naming_the_variables(environ, variables, message):
    environ(variables)
    with pytest.raises(ClusterConfigError, match=message):
        detect_platform()


def test_only_an_mpi_launch_lets_lightning_probe_mpi(environ):
    # Lightning's MPI probe starts MPI in the process: only a process an MPI launcher started may run it.
    assert detect_platform().environment is not None
    environ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"})
    assert detect_platform().environment is None


def test_a_machine_with_mpi4py_trains_without_mpirun(experiment, tmp_path):
    """NVIDIA's images ship mpi4py; importing its MPI module outside `mpirun` aborts the process (seen on an H200).

    A stand-in mpi4py whose MPI module ends the process on import, as Open MPI's singleton start does there."""
    site = tmp_path / "site"
    (site / "mpi4py").mkdir(parents=True)
    (site / "mpi4py" / "__init__.py").write_text("")
    (site / "mpi4py" / "MPI.py").write_text("import os\nos._exit(13)  # MPI_Init without a launcher\n")
    (site / "mpi4py-4.0.0.dist-info").mkdir()
    (site / "mpi4py-4.0.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: mpi4py\nVersion: 4.0.0\n")
    env = clean_env(PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    result = run_train("fit", *quick_run_args(experiment, tmp_path / "run"), "--trainer.max_steps", "2", env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]


def test_detection_is_not_fooled_by_the_other_platform(environ):
    environ(TORCHRUN)
    assert not PODEnvironment.detect() and not SINGEnvironment.detect()
    os.environ.clear()
    environ(SING_NODE_1)
    assert not PODEnvironment.detect()
    os.environ.clear()
    environ(POD_NODE_1)
    assert not SINGEnvironment.detect() and not SLURMEnvironment.detect()


def test_node_counts_of_lightning_platforms(environ):
    environ(TORCHRUN)
    assert detect_platform().num_nodes == 2
    os.environ.clear()
    environ(SLURM)
    assert detect_platform().num_nodes == 2


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        (TORCHRUN, ("LOCAL_WORLD_SIZE", 2)),
        ({**SLURM, "SLURM_NTASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "2(x2)"}, ("SLURM_NTASKS_PER_NODE", 2)),
        ({**SLURM, "SLURM_TASKS_PER_NODE": "2(x2)"}, ("SLURM_TASKS_PER_NODE", 2)),  # sbatch --ntasks=4 --nodes=2
        ({**SLURM, "SLURM_TASKS_PER_NODE": "3,1"}, ("SLURM_TASKS_PER_NODE", None)),  # nodes differ: no one count
        (SING_NODE_1, ("", None)),  # Lightning starts one process per device
        ({}, ("", None)),
    ],
)
def test_processes_per_node_come_from_the_launcher(environ, variables, expected):
    environ(variables)
    platform = detect_platform()
    assert (platform.processes_per_node_variable, platform.processes_per_node) == expected


def test_devices_follow_the_launcher_unless_set_to_the_same_count(environ):
    environ({**SLURM, "SLURM_NTASKS_PER_NODE": "2"})
    platform = detect_platform()
    assert devices_per_node("auto", platform) == 2
    assert devices_per_node(2, platform) == 2
    assert devices_per_node([0, 1], platform) == [0, 1]
    named_both = r"trainer\.devices=.* but SLURM_NTASKS_PER_NODE=2: Slurm started 2"
    for wrong in (3, "1", [0, 1, 2]):
        with pytest.raises(ClusterConfigError, match=named_both):
            devices_per_node(wrong, platform)
    os.environ.clear()
    environ({})
    assert devices_per_node("auto", detect_platform()) == "auto"  # Lightning counts the devices itself


@pytest.mark.parametrize("environment_class", [SINGEnvironment, PODEnvironment])
def test_ranks_before_launch_are_never_wrong(environ, environment_class):
    node_1 = SING_NODE_1 if environment_class is SINGEnvironment else POD_NODE_1
    environ({**node_1, "MASTER_PORT": "29400"})
    # Node 1's first process: not rank 0, and which rank depends on the devices the Trainer finds.
    first = environment_class()
    assert first.rank_before_launch() is None
    first.use_rank_before_launch()
    assert "RANK" not in os.environ and rank_zero_only.rank != 0
    # A process Lightning started on node 1 (what its launcher sets): 2 processes per node.
    os.environ.update(WORLD_SIZE="4", LOCAL_RANK="1", NODE_RANK="1")
    started = environment_class()
    started.use_rank_before_launch()
    assert (started.rank_before_launch(), os.environ["RANK"], rank_zero_only.rank) == (3, "3", 3)
    # Node 0's first process is rank 0.
    os.environ.clear()
    environ({**node_1, "SING_RANK": "0", "RANK": "0"})
    environment_class().use_rank_before_launch()
    assert rank_zero_only.rank == 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"SING_RANK": None}, "SING_RANK is not set"),
        ({"SING_WORLD_SIZE": None}, "SING_WORLD_SIZE is not set"),
        ({"SING_RANK": "one"}, "SING_RANK='one' is not an integer"),
        ({"SING_WORLD_SIZE": "2.5"}, "SING_WORLD_SIZE='2.5' is not an integer"),
        ({"SING_RANK": "2"}, r"SING_RANK=2 is outside 0..1 \(SING_WORLD_SIZE=2\)"),
        ({"SING_RANK": "-1"}, "SING_RANK=-1 is outside 0..1"),
        ({"SING_WORLD_SIZE": "0", "SING_RANK": "0"}, "SING_WORLD_SIZE=0 must be at least 1"),
        ({"SING_MASTER_ADDR": ""}, "SING_MASTER_ADDR is set but empty"),
        ({"SING_MASTER_ADDR": None, "SING_JOB_NAME": None}, "SING_MASTER_ADDR is not set"),
    ],
)
def test_bad_sing_variables_are_named(environ, change, message):
    environ({name: value for name, value in {**SING_NODE_1, **change}.items() if value is not None})
    with pytest.raises(ClusterConfigError, match=message):
        detect_platform()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"RANK": None}, "WORLD_SIZE=2 is set without RANK"),
        ({"RANK": "x"}, "RANK='x' is not an integer"),
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
        ({"RANK": "5"}, r"RANK=5 is outside 0..1 \(WORLD_SIZE=2\)"),
        ({"MASTER_ADDR": " "}, "MASTER_ADDR is set but empty"),
        ({"MASTER_ADDR": None, "SVC_NAME": None}, "MASTER_ADDR is not set"),
        ({"MASTER_PORT": "http"}, "MASTER_PORT='http' is not an integer"),
    ],
)
def test_bad_pod_variables_are_named(environ, change, message):
    environ({name: value for name, value in {**POD_NODE_1, **change}.items() if value is not None})
    with pytest.raises(ClusterConfigError, match=message):
        detect_platform()


def test_num_nodes_comes_from_the_platform(environ):
    environ(SING_NODE_1)
    platform = detect_platform()
    assert num_nodes(1, platform) == 2
    assert num_nodes(2, platform) == 2
    with pytest.raises(ClusterConfigError, match=r"trainer\.num_nodes=3 but SING_WORLD_SIZE=2"):
        num_nodes(3, platform)


def test_a_manual_launch_reads_world_size_as_processes_where_num_nodes_is_given(environ):
    environ({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "4", "NODE_RANK": "1"})
    platform = detect_platform(trainer_num_nodes=2)
    assert platform.name == "Lightning" and num_nodes(2, platform) == 2
    environ({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "3", "NODE_RANK": "1"})
    del os.environ[MANUAL_NUM_NODES]  # kept by the first process of a node; a new one here
    with pytest.raises(
        ClusterConfigError, match=r"WORLD_SIZE=3 is neither the number of nodes \(trainer.num_nodes=2\)"
    ):
        detect_platform(trainer_num_nodes=2)


def test_num_nodes_is_the_users_on_a_single_node(environ):
    environ({})
    assert num_nodes(1, detect_platform()) == 1


def test_validate_settings_checks_the_node_count_and_answering_the_roll_call_is_apart(environ):
    environ({**POD_NODE_1, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": str(free_port())})
    env = PODEnvironment(address_timeout=1, join_timeout=timedelta(seconds=5))
    env.validate_settings(num_devices=2, num_nodes=1)
    with pytest.raises(ClusterConfigError, match=r"trainer\.num_nodes=3 but WORLD_SIZE=1"):
        env.validate_settings(num_devices=2, num_nodes=3)
    env.call_the_roll(num_devices=2)  # the only node: it answers at once


@pytest.mark.parametrize("environment", [SINGEnvironment, PODEnvironment])
def test_validate_settings_checks_numbers_only_with_no_main_node_to_reach(environ, environment):
    # Lightning calls it as a check of numbers: no name lookup, no connection, whatever the timeouts.
    main = {"SING_MASTER_ADDR": "main.invalid", "MASTER_ADDR": "main.invalid", "MASTER_PORT": str(free_port())}
    environ({**POD_NODE_1, "SING_RANK": "1", "SING_WORLD_SIZE": "2", "RANK": "1", "WORLD_SIZE": "2", **main})
    env = environment(address_timeout=300, join_timeout=timedelta(minutes=5))
    started = time.monotonic()
    env.validate_settings(num_devices=2, num_nodes=2)
    assert time.monotonic() - started < 1


TORCHRUN_WORKER = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
                   "TORCHELASTIC_RUN_ID": "job", "MASTER_ADDR": "main", "MASTER_PORT": "29500"}  # fmt: skip
SRUN_TASK = {"SLURM_NTASKS": "4", "SLURM_JOB_NAME": "train", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
             "SLURM_NODEID": "0", "SLURM_NNODES": "2", "RANK": "1", "WORLD_SIZE": "4"}  # fmt: skip


@pytest.mark.parametrize("launched", [TORCHRUN_WORKER, SRUN_TASK], ids=["torchrun worker", "srun task"])
@pytest.mark.parametrize("environment", [SINGEnvironment, PODEnvironment])
def test_a_process_that_another_launcher_started_is_not_claimed(environ, environment, launched):
    environ({**launched, "SING_RANK": "0", "SING_WORLD_SIZE": "2"})
    assert not environment.detect()


ANSWER_ROLL_CALL = """
import sys
import time
from datetime import timedelta
from trainkit.cluster import roll_call as module
from trainkit.cluster.roll_call import roll_call
port, node_rank, num_nodes, processes, seconds, answer_after = map(int, sys.argv[1:])
if answer_after >= 0:  # this node answers only once that node has: it is the last to answer
    open_store = module._open_store
    def open_store_then_wait(*args, **kwargs):
        store = open_store(*args, **kwargs)
        store.wait([f"roll-call/node-{answer_after}"])
        return store
    module._open_store = open_store_then_wait
try:
    store = roll_call("127.0.0.1", port, node_rank, num_nodes, processes, "RANK", timedelta(seconds=seconds))
    # The job goes on with the store, as torch's process group does: node 0 serves it until the others are done
    # with it (else a node still reading the answers would lose it, which is not what this test is about).
    if node_rank == 0:
        while store.add("test/done", 0) < num_nodes - 1:
            time.sleep(0.05)
    else:
        store.add("test/done", 1)  # this node's last use of the store
    print("joined")
except Exception as error:
    print(f"{type(error).__name__}: {error}")
"""


def answer_roll_calls(
    nodes: list[tuple[int, int]], num_nodes: int = 2, seconds: int = 20, main_answers_after: int = -1
) -> list[str]:
    """Each (node rank, processes) answers the roll call in a process of its own; what each one ended with.

    `main_answers_after`: node 0 answers only once that node has."""
    port, answering = free_port(), []
    for node_rank, processes in nodes:
        answer_after = main_answers_after if node_rank == 0 else -1
        arguments = [str(value) for value in (port, node_rank, num_nodes, processes, seconds, answer_after)]
        answering.append(subprocess.Popen([sys.executable, "-c", ANSWER_ROLL_CALL, *arguments], env=clean_env(),
                                          stdout=subprocess.PIPE, text=True))  # fmt: skip
        time.sleep(0.5)  # node 0 first: it serves the store
    return [process.communicate(timeout=seconds + 60)[0].strip() for process in answering]


def test_roll_call_lets_nodes_that_agree_form_the_job():
    assert answer_roll_calls([(0, 2), (1, 2)]) == ["joined", "joined"]


def test_roll_call_names_a_rank_two_nodes_claim():
    outcomes = answer_roll_calls([(0, 2), (0, 2)])
    for outcome in outcomes:
        assert outcome.startswith("ClusterConfigError: two nodes claim node rank 0: host"), outcomes
        assert "give each node its own RANK (0..1)" in outcome


def test_roll_call_names_nodes_that_start_different_numbers_of_processes():
    outcomes = answer_roll_calls([(0, 2), (1, 3)])
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0].startswith("ClusterConfigError: the nodes start different numbers of processes (node 0")
    assert " 2, node 1 " in outcomes[0] and outcomes[0].split("node 1 ")[1].startswith("(")


def test_a_main_node_that_answers_last_and_refuses_lets_every_node_hear_why():
    # Node 0 serves the store and ends on the verdict; a node polling the store must read it before it goes.
    for _ in range(3):
        outcomes = answer_roll_calls([(0, 2), (1, 3)], main_answers_after=1)
        assert outcomes[0] == outcomes[1], outcomes
        assert outcomes[1].startswith("ClusterConfigError: the nodes start different numbers of processes"), outcomes


def test_roll_call_names_the_node_that_did_not_arrive():
    started = time.monotonic()
    (outcome,) = answer_roll_calls([(0, 2)], num_nodes=3, seconds=2)
    assert outcome.startswith("NodesDidNotArrive: only 1 of 3 nodes joined at 127.0.0.1:"), outcome
    assert "within 0:00:02 (cluster.join_timeout): node 1, 2 did not arrive" in outcome
    assert time.monotonic() - started < 30


CHECK_IN = """
import sys
from datetime import timedelta
from trainkit.cluster import waiting
from trainkit.cluster.arrival import wait_for_every_process
port, rank, world_size = map(int, sys.argv[1:])
try:
    wait_for_every_process("127.0.0.1", port, rank, world_size, 2, timedelta(seconds=2))
    print("joined")
except Exception as error:
    print(f"{type(error).__name__}: {error}")
"""


def test_processes_that_did_not_check_in_are_named_with_their_node():
    port = free_port()
    checking_in = [subprocess.Popen([sys.executable, "-c", CHECK_IN, str(port), str(rank), "4"], env=clean_env(),
                                    stdout=subprocess.PIPE, text=True) for rank in (0, 2)]  # fmt: skip
    outcomes = [process.communicate(timeout=180)[0].strip() for process in checking_in]
    assert outcomes[0].startswith(f"NodesDidNotArrive: only 2 of 4 processes joined at 127.0.0.1:{port}"), outcomes
    assert "within 0:00:02 (cluster.join_timeout): global rank 1, 3 of node 0, 1 did not arrive" in outcomes[0]
    assert outcomes[1].startswith("NodesDidNotArrive: "), outcomes  # the same line, or node 0 ended first


@pytest.fixture
def taken_port():
    """A port of this host held by an open connection, as an outgoing connection may take any port of the
    ephemeral range: nothing listens there, and nothing else can."""
    with socket.create_server(("127.0.0.1", 0)) as server, socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.connect(server.getsockname())
        yield holder.getsockname()[1]


@pytest.fixture
def port_of_another_program():
    """A port where a program listens that is not a store: it takes connections and never answers (a web
    server waiting for a request, say)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        yield listener.getsockname()[1]


@pytest.mark.parametrize("holder", ["taken_port", "port_of_another_program"])
@pytest.mark.parametrize(
    "serve",
    [
        lambda port: roll_call("127.0.0.1", port, 0, 2, 2, "RANK", timedelta(minutes=10)),
        lambda port: wait_for_every_process("127.0.0.1", port, 0, 2, 1, timedelta(minutes=10)),
    ],
    ids=["node 0 of the roll call", "global rank 0 checking in"],
)
def test_a_main_node_whose_port_is_taken_says_so_at_once(holder, serve, request):
    port = request.getfixturevalue(holder)
    started = time.monotonic()
    with pytest.raises(MainPortTaken, match=f"the main node cannot listen on port {port}: another process"):
        serve(port)
    assert time.monotonic() - started < 60  # not the 10 minutes of the join timeout


@pytest.mark.parametrize(
    "join",
    [
        lambda port: roll_call("127.0.0.1", port, 1, 2, 2, "RANK", timedelta(seconds=2)),
        lambda port: wait_for_every_process("127.0.0.1", port, 1, 2, 1, timedelta(seconds=2)),
    ],
    ids=["node 1 of the roll call", "global rank 1 checking in"],
)
def test_another_program_on_the_main_port_ends_the_other_nodes_within_the_join_timeout(port_of_another_program, join):
    """torch's client alone would wait for that program's answer forever."""
    started = time.monotonic()
    line = (
        f"the main node's 127.0.0.1:{port_of_another_program} took the connection but did not answer as torch's"
        " store within 0:00:02: another program listens on that port, not node 0; give the job a free port"
    )
    with pytest.raises(NodesDidNotArrive, match=re.escape(line)):
        join(port_of_another_program)
    assert time.monotonic() - started < 30


def test_unresolvable_main_address_fails_after_the_timeout_naming_the_host():
    with pytest.raises(ClusterConfigError, match=r"'test-0\.no-such-service\.invalid' did not resolve within 0\.3 s"):
        wait_until_resolvable("test-0.no-such-service.invalid", timeout=0.3, interval=0.1)


@pytest.fixture
def reminders(monkeypatch, caplog):
    """The waits' reminders every 0.3 s rather than every minute; what they said."""
    monkeypatch.setattr(waiting, "EVERY_SECONDS", 0.3)
    caplog.set_level(logging.INFO, logger=waiting.__name__)
    return caplog


def test_a_main_address_that_does_not_resolve_yet_is_waited_for_saying_so(reminders):
    with pytest.raises(ClusterConfigError):
        wait_until_resolvable("test-0.no-such-service.invalid", timeout=1, interval=0.1)
    assert "waiting for the main address 'test-0.no-such-service.invalid' to resolve" in reminders.text
    assert "giving up after 1 s (cluster.address_timeout)" in reminders.text


@pytest.mark.parametrize(
    "wait, waiting_for",
    [
        (lambda port: roll_call("127.0.0.1", port, 0, 3, 2, "RANK", timedelta(seconds=1)), "node 1, 2"),
        (lambda port: wait_for_every_process("127.0.0.1", port, 0, 2, 1, timedelta(seconds=1)), "global rank 1"),
    ],
    ids=["nodes", "processes"],
)
def test_a_job_waiting_to_form_says_for_whom_now_and_then(reminders, wait, waiting_for):
    port = free_port()
    with pytest.raises(NodesDidNotArrive):
        wait(port)
    reminder = f"waiting for {waiting_for} to join at 127.0.0.1:{port}; giving up after 0:00:01 (cluster.join_timeout)"
    assert reminder in reminders.text


def test_settings_default_timeout_is_far_below_torchs_30_minutes():
    assert ClusterSettings().timeout <= timedelta(minutes=10)


def test_describe_names_platform_node_and_main_address(environ):
    environ(SING_NODE_1)
    line = describe(detect_platform())
    assert "platform=SING node_rank=1 num_nodes=2" in line
    assert "main=test-0.test-service.demo-project.svc.cluster.local:" in line


@pytest.mark.parametrize(
    ("variables", "expected", "code"),
    [
        (POD_NODE_1, "platform=POD node_rank=1 num_nodes=2 host=test-1.test-service", 0),
        ({**POD_NODE_1, "RANK": "7"}, "error: RANK=7 is outside 0..1", 2),
    ],
)
def test_cluster_module_prints_the_setup(variables, expected, code):
    result = subprocess.run(
        [sys.executable, "-m", "trainkit.cluster"],
        env=clean_env(**variables),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == code
    assert expected in result.stdout + result.stderr
