"""Real multi-node runs on CPU: 2 simulated nodes x 2 processes on 127.0.0.1, over gloo.

Each node is its own process tree, started with only its platform's variables and the plain
entry command, as the platform would start it. A run passes only if the 4 processes formed
one job (world size 4, global ranks 0..3, the right node ranks) and ended with identical weights.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainkit.run.nccl import DEFAULTS as NCCL_DEFAULTS

from .drills import node_envs, start_node, start_nodes
from .helpers import PROJECT_ROOT, TRAIN_SCRIPT, clean_env, free_port, quick_run_args, run_train

pytestmark = pytest.mark.slow

DEVICES_PER_NODE = 2


def train_command(experiment: Path, tmp_path: Path) -> list[str]:
    """`fit` for a few steps; each process reports its ranks. Devices per node: left to the platform."""
    return [
        "fit",
        *quick_run_args(experiment, tmp_path / "run"),
        "--trainer.callbacks+=trainkit.testing.rank_report.ReportRank",
        "--trainer.callbacks.out_dir", str(tmp_path / "reports"),
    ]  # fmt: skip


def node_level_command(experiment: Path, tmp_path: Path) -> list[str]:
    """SING and POD start one process per node; Lightning starts one per device ("auto" is 1 on a CPU)."""
    devices = ["--trainer.devices", str(DEVICES_PER_NODE)]
    return [sys.executable, str(TRAIN_SCRIPT), *train_command(experiment, tmp_path), *devices]


def torchrun_command(experiment: Path, tmp_path: Path, *options: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", *options, "--nproc-per-node", str(DEVICES_PER_NODE),
        str(TRAIN_SCRIPT), *train_command(experiment, tmp_path),
    ]  # fmt: skip


def wait_for_job(nodes: list[subprocess.Popen], logs: Path, timeout: float = 240) -> None:
    for index, node in enumerate(nodes):
        try:
            code = node.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in nodes:
                other.kill()
            code = "timeout"
        assert code == 0, f"node {index} ended with {code}:\n" + (logs / f"node{index}.log").read_text()[-4000:]


def assert_one_job(reports_dir: Path, num_nodes: int) -> None:
    reports = [json.loads(path.read_text()) for path in sorted(reports_dir.glob("rank*.json"))]
    world = num_nodes * DEVICES_PER_NODE
    assert sorted(report["global_rank"] for report in reports) == list(range(world))
    for report in reports:
        assert report["world_size"] == world
        assert report["global_rank"] == report["node_rank"] * DEVICES_PER_NODE + report["local_rank"]
        settings = report["nccl_settings"]  # what the kit sets in every process (trainkit/run/nccl.py)
        # torchrun sets its own 1, which also ends a process whose collective failed (SIGABRT).
        assert settings["TORCH_NCCL_ASYNC_ERROR_HANDLING"] in ("1", "3"), settings
        assert settings["TORCH_FR_BUFFER_SIZE"] == NCCL_DEFAULTS["TORCH_FR_BUFFER_SIZE"], "no flight recorder"
        assert settings["TORCH_NCCL_DUMP_ON_TIMEOUT"] == NCCL_DEFAULTS["TORCH_NCCL_DUMP_ON_TIMEOUT"], "no dump"
    assert len({report["weights"] for report in reports}) == 1, "ranks ended with different weights"
    assert {report["global_step"] for report in reports} == {4}


def without_wandb_key(env: dict[str, str]) -> dict[str, str]:
    """Let the project choose wandb's mode, with no key anywhere: it logs offline and says so."""
    env = {name: value for name, value in env.items() if name not in ("WANDB_MODE", "WANDB_API_KEY")}
    return {**env, "NETRC": "/nonexistent/netrc"}


@pytest.mark.parametrize("platform", ["SING", "POD"])
def test_two_nodes_of_two_processes(platform, experiment, tmp_path):
    port = free_port()
    command = [*node_level_command(experiment, tmp_path), "--cluster.main_port", str(port)]
    envs = [without_wandb_key(env) for env in node_envs(platform, port)]
    nodes = start_nodes([command, command], envs, tmp_path / "logs")
    wait_for_job(nodes, tmp_path / "logs")
    assert_one_job(tmp_path / "reports", num_nodes=2)
    logs = [(tmp_path / "logs" / f"node{index}.log").read_text() for index in range(2)]
    assert f"[{platform}] node_rank=0 local_rank=1 global_rank=1 world_size=4 main=127.0.0.1:{port}" in logs[0]

    # Before the job forms, no process prints a rank it will not have, and rank 0's messages appear once.
    for node, log in enumerate(logs):
        node_ranks = {node * DEVICES_PER_NODE + local for local in range(DEVICES_PER_NODE)}
        printed = {int(rank) for rank in re.findall(r"\[rank: (\d+)\] Seed set to", log)}
        assert printed <= node_ranks, f"node {node} printed ranks {printed}:\n{log[-3000:]}"
    for once in ("so this run logs offline", "GPU available:"):
        assert [log.count(once) for log in logs] == [1, 0], once


ACME_ENVIRONMENT = '''"""ACME, a made-up cloud: one container per node with ACME_NODE_INDEX, ACME_NODES, ACME_HEAD."""

import os

from trainkit.cluster.launch_variables import require, require_rank_and_size
from trainkit.cluster.node_level import NodeLevelEnvironment


class AcmeEnvironment(NodeLevelEnvironment):
    platform = "ACME"
    node_rank_variable = "ACME_NODE_INDEX"
    node_count_variable = "ACME_NODES"

    @staticmethod
    def detect() -> bool:
        return "ACME_NODE_INDEX" in os.environ

    def _read_node_rank_and_count(self) -> tuple[int, int]:
        return require_rank_and_size("ACME_NODE_INDEX", "ACME_NODES")

    def _read_main_address(self) -> str:
        return require("ACME_HEAD")

    def host(self, node_rank: int) -> str | None:
        return None
'''


def test_a_cluster_environment_of_the_researchers_own_trains_two_nodes_of_two_processes(experiment, tmp_path):
    """A platform with variables of its own: one ClusterEnvironment in the researcher's package, named in a config."""
    package = tmp_path / "my_research"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "acme.py").write_text(ACME_ENVIRONMENT)
    port = free_port()
    named = ["--cluster.main_port", str(port), "--cluster.environments", '["my_research.acme.AcmeEnvironment"]']
    command = [*node_level_command(experiment, tmp_path), *named]
    pythonpath = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    envs = [clean_env(ACME_NODE_INDEX=str(node), ACME_NODES="2", ACME_HEAD="127.0.0.1", PYTHONPATH=pythonpath)
            for node in range(2)]  # fmt: skip
    nodes = start_nodes([command, command], envs, tmp_path / "logs")
    wait_for_job(nodes, tmp_path / "logs")
    assert_one_job(tmp_path / "reports", num_nodes=2)
    log = (tmp_path / "logs" / "node1.log").read_text()
    assert f"[ACME] node_rank=1 local_rank=1 global_rank=3 world_size=4 main=127.0.0.1:{port}" in log, log[-3000:]

    # Where its variables are not set, the same config runs on the platforms trainkit knows, or on one machine.
    result = run_train("fit", *quick_run_args(experiment, tmp_path / "laptop"), *named, env=clean_env(
        PYTHONPATH=pythonpath))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("platform", ["POD", "Lightning"])
def test_nodes_that_start_further_apart_than_the_timeout_still_form_one_job(platform, experiment, tmp_path):
    """Nodes start at different moments (an image pull, a busy scheduler): their wait is `cluster.join_timeout`'s,
    not the collectives' `cluster.timeout`. On POD, node 0 waits in the roll call for node 1 (the container test
    has a node wait for DNS); under Lightning's manual launch, node 0's processes wait for node 1's at check-in."""
    port = free_port()
    # No logger: the first process starts wandb before Lightning's first barrier, which beside another
    # training took longer than this short timeout.
    command = [*node_level_command(experiment, tmp_path), "--cluster.timeout", "0:00:10", "--trainer.logger", "false"]
    lightning = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    envs = (
        node_envs("POD", port)
        if platform == "POD"
        else [clean_env(**lightning, NODE_RANK=str(rank)) for rank in (0, 1)]
    )
    node0 = start_node(command, envs[0], tmp_path / "logs" / "node0.log")
    time.sleep(15)
    node1 = start_node(command, envs[1], tmp_path / "logs" / "node1.log")
    wait_for_job([node0, node1], tmp_path / "logs")
    assert_one_job(tmp_path / "reports", num_nodes=2)


def test_torchrun_two_nodes_with_c10d_rendezvous(experiment, tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    commands = [
        torchrun_command(experiment, tmp_path, "--nnodes", "2", "--node-rank", str(rank), "--rdzv-backend", "c10d",
                         "--rdzv-endpoint", endpoint, "--rdzv-id", "test")
        for rank in range(2)
    ]  # fmt: skip
    nodes = start_nodes(commands, [clean_env(), clean_env()], tmp_path / "logs")
    wait_for_job(nodes, tmp_path / "logs")
    assert_one_job(tmp_path / "reports", num_nodes=2)
    assert "[torchrun]" in (tmp_path / "logs" / "node0.log").read_text()


def test_torchrun_decides_the_processes_per_node(experiment, tmp_path):
    # trainer.devices is "auto" in the config: on a CPU that alone would mean 1 device, not torchrun's 2.
    (node,) = start_nodes([torchrun_command(experiment, tmp_path, "--standalone")], [clean_env()], tmp_path / "logs")
    wait_for_job([node], tmp_path / "logs")
    assert_one_job(tmp_path / "reports", num_nodes=1)


def test_torchrun_refuses_a_different_device_count_in_one_line(experiment, tmp_path):
    command = [*torchrun_command(experiment, tmp_path, "--standalone"), "--trainer.devices", "3"]
    result = subprocess.run(command, cwd=PROJECT_ROOT, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: trainer.devices=3 but LOCAL_WORLD_SIZE=2: torchrun started 2 processes on this node;"
        " leave trainer.devices at auto, the launcher sets it"
    ], result.stderr[-3000:]
    assert not (tmp_path / "reports").exists()


def test_torchrun_inside_sing_nodes_forms_one_job_of_every_process(experiment, tmp_path):
    # The natural entry command on a SING node with several GPUs: torchrun wins over SING, as in Lightning.
    port = free_port()
    commands = [
        torchrun_command(experiment, tmp_path, "--nnodes", "2", "--node-rank", str(rank), "--rdzv-backend", "c10d",
                         "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "test")
        for rank in range(2)
    ]  # fmt: skip
    nodes = start_nodes(commands, node_envs("SING", port), tmp_path / "logs")
    wait_for_job(nodes, tmp_path / "logs")
    assert_one_job(tmp_path / "reports", num_nodes=2)
    assert "[torchrun]" in (tmp_path / "logs" / "node0.log").read_text()


def test_torchrun_on_one_node_of_a_two_node_sing_job_is_refused_in_one_line(experiment, tmp_path):
    command = torchrun_command(experiment, tmp_path, "--standalone")
    sing_node_0 = node_envs("SING", free_port())[0]
    result = subprocess.run(command, cwd=PROJECT_ROOT, env=sing_node_0, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "but this SING job has 2 (SING_WORLD_SIZE=2)" in errors[0], result.stderr[-3000:]
    assert "--nnodes 2 --node-rank $SING_RANK --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:" in errors[0]
    assert not (tmp_path / "reports").exists()


@pytest.mark.parametrize(
    "world_size, num_nodes_flag",
    [("4", ["--trainer.num_nodes", "2"]), ("2", [])],
    ids=["WORLD_SIZE processes, num_nodes given (Lightning's docs)", "WORLD_SIZE nodes"],
)
def test_lightnings_manual_launch_on_two_nodes_of_two_processes(experiment, tmp_path, world_size, num_nodes_flag):
    # Lightning's documented launch on a general-purpose cluster: these four variables on each node.
    port = free_port()
    envs = [clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=world_size, NODE_RANK=str(rank))
            for rank in range(2)]  # fmt: skip
    command = [*node_level_command(experiment, tmp_path), *num_nodes_flag]
    nodes = start_nodes([command, command], envs, tmp_path / "logs")
    wait_for_job(nodes, tmp_path / "logs")
    assert_one_job(tmp_path / "reports", num_nodes=2)
    node1_log = (tmp_path / "logs" / "node1.log").read_text()
    assert "[Lightning] node_rank=1 local_rank=1 global_rank=3 world_size=4" in node1_log
