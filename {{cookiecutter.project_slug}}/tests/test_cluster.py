"""The SING and POD environments and platform detection, over the platforms' documented examples."""

import os
import subprocess
import sys
from datetime import timedelta

import pytest
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_only

from {{ cookiecutter.package_name }}.cli import devices_per_node, num_nodes
from {{ cookiecutter.package_name }}.cluster import (
    DEFAULT_MAIN_PORT,
    ClusterConfigError,
    ClusterSettings,
    PODEnvironment,
    SINGEnvironment,
    describe,
    detect_platform,
    wait_until_resolvable,
)

from .conftest import clean_env

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


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        (SING_NODE_1, "SING"),
        (POD_NODE_1, "POD"),
        ({**POD_NODE_1, **SING_NODE_1}, "SING"),  # SING is checked first
        (TORCHRUN, "torchrun"),
        ({**TORCHRUN, "JOB_NAME": "test", "SVC_NAME": "svc", "POD_NAMESPACE": "ns"}, "torchrun"),  # torchrun in a pod
        (SLURM, "Slurm"),
        ({}, "local"),
    ],
)
def test_detection(environ, variables, expected):
    environ(variables)
    assert detect_platform().name == expected


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
        ({"RANK": None}, "RANK is not set"),
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


def test_num_nodes_is_the_users_on_a_single_node(environ):
    environ({})
    assert num_nodes(1, detect_platform()) == 1


def test_validate_settings_checks_node_count_and_resolves_the_main_address(environ):
    environ({**POD_NODE_1, "MASTER_ADDR": "localhost"})
    env = PODEnvironment(address_timeout=1)
    env.validate_settings(num_devices=2, num_nodes=2)
    with pytest.raises(ClusterConfigError, match=r"trainer\.num_nodes=3 but WORLD_SIZE=2"):
        env.validate_settings(num_devices=2, num_nodes=3)


def test_unresolvable_main_address_fails_after_the_timeout_naming_the_host():
    with pytest.raises(ClusterConfigError, match=r"'test-0\.no-such-service\.invalid' did not resolve within 0\.3 s"):
        wait_until_resolvable("test-0.no-such-service.invalid", timeout=0.3, interval=0.1)


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
        [sys.executable, "-m", "{{ cookiecutter.package_name }}.cluster"],
        env=clean_env(**variables),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == code
    assert expected in result.stdout + result.stderr
