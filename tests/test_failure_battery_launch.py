"""The failure battery, launches: bad platform variables and nodes that disagree, each done for real.

Each case runs the default generated project's `train.py fit` on the real digits, on CPU, with only
the variables a platform would set. Promised: a wrong launch ends in seconds with exit 2 and one
`error:` line that names the variable or the disagreement; nothing waits for a timeout.
"""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from .battery import Ending, assert_refused, run_project
from .launch_runs import launch_environment, quick_cpu_run
from .slurm_cluster import free_port

CONFIG_ERROR = 2
EXPERIMENT = ["--config", "configs/experiment.yaml"]
POD = {
    "JOB_NAME": "test",
    "SVC_NAME": "test-service",
    "POD_NAMESPACE": "demo-project",
    "MASTER_ADDR": "127.0.0.1",
}
SING = {"SING_WORLD_SIZE": "2", "SING_JOB_NAME": "test", "SING_MASTER_ADDR": "127.0.0.1",
        "SING_HOSTNAME_SUFFIX": "test-service.demo-project.svc.cluster.local"}  # fmt: skip

BAD_VARIABLES = {
    "POD RANK empty": ({**POD, "RANK": "", "WORLD_SIZE": "2"}, "RANK is set but empty"),
    "POD RANK not a number": ({**POD, "RANK": "one", "WORLD_SIZE": "2"}, "RANK='one' is not an integer"),
    "MASTER_PORT above 65535": (
        {**POD, "RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a port number",
    ),
    "MASTER_PORT 0": ({**POD, "RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "0"}, "MASTER_PORT=0 is not a port"),
    "SING and POD variables together": (
        {**SING, "SING_RANK": "0", "RANK": "0", "WORLD_SIZE": "2"}, "both SING variables",
    ),
    "RANK without WORLD_SIZE": ({"RANK": "1"}, "RANK=1 is set without WORLD_SIZE"),
    "WORLD_SIZE alone": ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set without RANK"),
    "SING_RANK outside the job": ({**SING, "SING_RANK": "2"}, "SING_RANK=2 is outside 0..1"),
    "manual launch, NODE_RANK outside the job": (
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "2", "NODE_RANK": "2"},
        "NODE_RANK=2 is outside 0..1",
    ),
    "LOCAL_RANK negative": ({"LOCAL_RANK": "-1"}, "LOCAL_RANK=-1 is negative"),
}  # fmt: skip


@pytest.mark.parametrize(("variables", "message"), BAD_VARIABLES.values(), ids=BAD_VARIABLES)
def test_a_bad_platform_variable_is_refused_at_once_naming_it(default_project, real_mnist, tmp_path, variables,
                                                               message):  # fmt: skip
    env = launch_environment(default_project, **variables)
    ending = run_project(
        default_project,
        "fit",
        *EXPERIMENT,
        *quick_cpu_run(real_mnist, tmp_path),
        env=env,
        timeout=120,
    )
    assert_refused(ending, CONFIG_ERROR, message, within=30)
    assert not (tmp_path / "run").exists(), "the run started"


def start_two_nodes(project: Path, data: Path, out: Path, envs: list[dict], devices: list[int]) -> list[Ending]:
    """Two POD nodes as separate process trees; how each ended."""
    started = time.monotonic()
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "train.py",
                "fit",
                *EXPERIMENT,
                *quick_cpu_run(data, out / f"node{index}"),
                "--trainer.devices",
                str(count),
                "--cluster.timeout",
                "0:01:00",
            ],
            cwd=project,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for index, (env, count) in enumerate(zip(envs, devices, strict=True))
    ]
    endings = []
    for node in nodes:
        try:
            stdout, stderr = node.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for other in nodes:
                other.kill()
            pytest.fail("a node waited for the other until killed")
        endings.append(Ending(node.returncode, time.monotonic() - started, stdout, stderr))
    return endings


def test_two_nodes_that_claim_one_rank_are_named_at_once(default_project, real_mnist, tmp_path):
    port = str(free_port())
    env = launch_environment(default_project, **POD, RANK="0", WORLD_SIZE="2", MASTER_PORT=port)
    endings = start_two_nodes(default_project, real_mnist, tmp_path, [env, env], devices=[2, 2])
    for ending in endings:  # far sooner than the 60 s cluster.timeout after which it would fail as a lost node
        assert_refused(
            ending,
            CONFIG_ERROR,
            "two nodes claim node rank 0: host",
            within=45,
            first=False,
        )
        assert "give each node its own RANK (0..1)" in ending.error_lines[0]


def test_nodes_that_start_different_numbers_of_processes_are_named_at_once(default_project, real_mnist, tmp_path):
    port = str(free_port())
    envs = [launch_environment(default_project, **POD, RANK=str(rank), WORLD_SIZE="2", MASTER_PORT=port)
            for rank in range(2)]  # fmt: skip
    endings = start_two_nodes(default_project, real_mnist, tmp_path, envs, devices=[2, 3])
    for ending in endings:
        assert_refused(
            ending,
            CONFIG_ERROR,
            "the nodes start different numbers of processes",
            within=45,
            first=False,
        )
        assert "node 0 (" in ending.error_lines[0] and ") 2, node 1 (" in ending.error_lines[0]
        assert ending.error_lines[0].split(", node 1 (")[1].split(")")[1].startswith(" 3")
