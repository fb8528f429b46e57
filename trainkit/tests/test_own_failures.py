"""An error of one process's own ends every process of a 2 nodes x 2 processes job with its status, not 75.

A bug that only one process's data meets (or in code only global rank 0 runs) fails again on every
retry, so no node may exit 75 (a lost node, which the platforms retry): every process ends with 1
and a line naming the process that failed, on every platform, whichever process it was: a node's
second process, the main node's first (which holds the job's store), or under torchrun a node's first.
"""

import re
import time
from pathlib import Path

import pytest

from .drills import quick_run_args, start_nodes, two_node_job
from .helpers import free_port
from .test_lost_peers import end_of_job, logs_of

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("platform", "failing"), [("POD", 3), ("SING", 0), ("torchrun", 2)])
def test_an_error_in_one_process_ends_every_node_with_its_status(platform, failing, experiment, tmp_path):
    args = ["fit", *quick_run_args(experiment, tmp_path / "run"), "--model", "tasks.broken.FailsOnOneProcess",
            "--model.failing_rank", str(failing), "--data", "tasks.regression.Table",
            "--best_checkpoint.monitor", "val_loss"]  # fmt: skip
    error = f"RuntimeError: a row that only global rank {failing} reads"
    assert_every_node_ends_with_1(platform, args, failing, error, tmp_path)


def test_an_error_while_preparing_data_ends_every_node_with_its_status(experiment, tmp_path):
    """Node 1's first process fails in `prepare_data`, while the others wait in Lightning's barrier (no timeout)."""
    args = ["fit", *quick_run_args(experiment, tmp_path / "run"), "--model", "tasks.regression.Regressor",
            "--data", "tasks.broken.FailsToDownload", "--best_checkpoint.monitor", "val_loss"]  # fmt: skip
    error = "RuntimeError: the download's checksum does not match on node 1"
    assert_every_node_ends_with_1("SING", args, 2, error, tmp_path)


def assert_every_node_ends_with_1(platform: str, args: list[str], failing: int, error: str, tmp_path: Path) -> None:
    """Run the job; global rank `failing` fails with `error`, and every other process names it and ends with 1."""
    commands, envs = two_node_job(platform, args, free_port())
    started = time.monotonic()
    nodes = start_nodes(commands, envs, tmp_path / "logs")
    codes = end_of_job(nodes, within=240)
    elapsed = time.monotonic() - started
    logs = [(tmp_path / "logs" / f"node{index}.log").read_text() for index in range(2)]
    assert codes == [1, 1], logs_of(tmp_path)
    assert error in logs[failing // 2], logs_of(tmp_path)
    failed_node = failing // 2
    named = re.compile(
        rf"error: global rank {failing} \(node {failed_node}, host \S+\) failed with {re.escape(error)}: its log has"
        r" the traceback. Global rank (\d) ends with it, exiting with 1"
    )
    # Every other process of the job names it, the other node's two processes among them, and none saw a lost node.
    ending = {int(rank) for log in logs for rank in named.findall(log)}
    other_node = 1 - failed_node
    assert {2 * other_node, 2 * other_node + 1} <= ending, logs_of(tmp_path)
    assert failing not in ending, logs_of(tmp_path)
    assert not any("lost contact" in log or "lost a peer" in log for log in logs), logs_of(tmp_path)
    print(f"{platform}: global rank {failing} failed; the job ended within {elapsed:.0f} s of its start")
