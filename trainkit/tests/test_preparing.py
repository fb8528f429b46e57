"""A node that freezes while the job prepares its data ends the others with 75 and a line naming it.

Lightning waits around `prepare_data` with no timeout; the kit's signs of life (run/preparing.py)
stand in for one. A node that is only slow there (a long download) must not be cut short.
"""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from .drills import full_epochs_args, process_tree, start_nodes, two_node_job
from .helpers import free_port
from .test_lost_peers import blame_only_node_1, end_of_job, logs_of

pytestmark = pytest.mark.slow

TIMEOUT_SECONDS = 20  # as in the lost-peer drills: on a busy machine the job may take 15 s to form


def start_job(platform: str, experiment: Path, tmp_path: Path, download_seconds: float) -> list[subprocess.Popen]:
    """Two nodes of two processes each; node 1's first process downloads for `download_seconds`."""
    args = ["fit", *full_epochs_args(experiment, tmp_path / "run", epochs=1),
            "--cluster.timeout", f"0:00:{TIMEOUT_SECONDS}", "--data", "tasks.slow_download.SlowDownload",
            "--data.marker", str(tmp_path / "downloading"), "--data.seconds", str(download_seconds)]  # fmt: skip
    commands, envs = two_node_job(platform, args, free_port())
    return start_nodes(commands, envs, tmp_path / "logs")


def wait_for_the_download(marker: Path, nodes: list[subprocess.Popen], tmp_path: Path) -> None:
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert time.monotonic() < deadline and all(node.poll() is None for node in nodes), logs_of(tmp_path)
        time.sleep(0.1)


# SING and POD nodes wait for each other the same way (NodeLevelEnvironment), torchrun's differently: one each.
PLATFORMS = ["SING", "torchrun"]


@pytest.mark.parametrize("platform", PLATFORMS)
def test_a_node_that_freezes_while_preparing_data_ends_the_others_with_75(platform, experiment, tmp_path):
    nodes = start_job(platform, experiment, tmp_path, download_seconds=600)
    wait_for_the_download(tmp_path / "downloading", nodes, tmp_path)
    # (That a download longer than cluster.timeout is not a stall is the last test's.)
    assert [node.poll() for node in nodes] == [None, None], logs_of(tmp_path)
    tree = process_tree(nodes[1].pid)
    for pid in tree[1:] if platform == "torchrun" else tree:  # torchrun's agent goes on, as beside a hung driver
        os.kill(pid, signal.SIGSTOP)
    assert_node_0_ends_naming_node_1(nodes, tmp_path)
    assert "while it prepared data" in logs_of(tmp_path)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_a_node_that_dies_while_preparing_data_ends_the_others_with_75(platform, experiment, tmp_path):
    nodes = start_job(platform, experiment, tmp_path, download_seconds=600)
    wait_for_the_download(tmp_path / "downloading", nodes, tmp_path)
    for pid in process_tree(nodes[1].pid):  # a machine that is gone: preempted, powered off
        os.kill(pid, signal.SIGKILL)
    assert_node_0_ends_naming_node_1(nodes, tmp_path)


def assert_node_0_ends_naming_node_1(nodes: list[subprocess.Popen], tmp_path: Path) -> None:
    started = time.monotonic()
    codes = end_of_job(nodes[:1], within=TIMEOUT_SECONDS + 30)
    elapsed = time.monotonic() - started
    end_of_job(nodes[1:], within=0)
    log = logs_of(tmp_path)
    assert codes == [75], log
    assert elapsed < TIMEOUT_SECONDS + 30, log
    assert blame_only_node_1(tmp_path / "logs" / "node0.log"), log


def test_a_node_that_downloads_longer_than_the_timeout_trains_with_the_others(experiment, tmp_path):
    nodes = start_job("POD", experiment, tmp_path, download_seconds=TIMEOUT_SECONDS + 10)
    codes = end_of_job(nodes, within=300)
    assert codes == [0, 0], logs_of(tmp_path)
