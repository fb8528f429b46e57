"""A lost or stalled peer ends every other process of a 2 nodes x 2 processes job with exit 75 and a line naming it.

NCCL's watchdog ends a process whose collective failed with SIGABRT; here, on CPU over gloo, the
drills send that SIGABRT themselves, to a node's second process and to its first (the one
Lightning started the other from). A stalled node (SIGSTOP: its connections stay open, as with a
hung driver) must be told from a slow one only by `cluster.timeout`. A process whose main thread hangs
while its other threads run on (a hung device call or file read) answers for itself: it is named as
stuck, with where its main thread is, and ends too.
"""

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from .drills import full_epochs_args, last_words, paced, process_tree, start_nodes, two_node_job, wait_for
from .helpers import free_port

pytestmark = pytest.mark.slow

TIMEOUT_SECONDS = 20
PLATFORMS = ["SING", "POD", "torchrun"]


def start_job(
    platform: str, experiment: Path, tmp_path: Path, *extra_args: str, processes: int = 2
) -> tuple[list[subprocess.Popen], Path]:
    """Two nodes of `processes` processes each, paced, with the marker written after step 3."""
    marker = tmp_path / "step-3"
    args = ["fit", *full_epochs_args(experiment, tmp_path / "run", epochs=4),
            "--cluster.timeout", f"0:00:{TIMEOUT_SECONDS}", *paced(marker, at_step=3), *extra_args]  # fmt: skip
    commands, envs = two_node_job(platform, args, free_port(), processes)
    nodes = start_nodes(commands, envs, tmp_path / "logs")
    wait_for(marker, nodes[0], tmp_path / "logs" / "node0.log")
    deadline = time.monotonic() + 30
    while not all(Path(f"{marker}.rank{rank}").exists() for rank in range(2 * processes)):
        assert time.monotonic() < deadline, "not every process reached step 3"
        time.sleep(0.1)
    return nodes, marker


def pid_of(marker: Path, global_rank: int) -> int:
    return int(Path(f"{marker}.rank{global_rank}").read_text())


def end_of_job(nodes: list[subprocess.Popen], within: float) -> list[int | str]:
    """Each node's exit status once the job ended, "hung" for a node still running after `within` seconds."""
    deadline = time.monotonic() + within
    codes: list[int | str] = []
    for node in nodes:
        try:
            codes.append(node.wait(timeout=max(deadline - time.monotonic(), 0.1)))
        except subprocess.TimeoutExpired:
            codes.append("hung")
    for node in nodes:
        for pid in reversed(process_tree(node.pid)):  # what a drill left behind: stopped or hung processes
            for signum in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)
        node.wait()
    return codes


def error_line(platform: str, node: int, log: Path) -> str:
    """The node's closing error line: its last line (its first process's, which waits for the others), or
    under torchrun, where no process waits for another, its first process's (global rank 2 x node)."""
    if platform != "torchrun":
        return last_words(log)
    errors = [line for line in log.read_text().splitlines() if line.startswith("error:")]
    first = [line for line in errors if f"(global rank {2 * node})" in line]
    return (first or errors or [""])[-1]


def blame_only_node_1(log: Path) -> bool:
    """Whether node 0's processes each ended with a line that names node 1 as lost, and not their own node
    (a survivor blocked in a collective that the loss does not end must still answer the roll call)."""
    lines = [line for line in log.read_text().splitlines() if line.startswith("error: node 0 (global rank")]
    return len(lines) == 2 and all("node 1 (host" in line and "node 0 (host" not in line for line in lines)


def logs_of(tmp_path: Path) -> str:
    return "\n".join(f"--- node{index}:\n" + (tmp_path / "logs" / f"node{index}.log").read_text()[-3000:]
                     for index in range(2))  # fmt: skip


# A node's first process (global rank 2) started the other under Lightning's launcher, the same on SING and POD;
# under torchrun its agent started both.
@pytest.mark.parametrize(
    ("platform", "aborted"), [*((platform, 3) for platform in PLATFORMS), ("SING", 2), ("torchrun", 2)],
    ids=[*(f"second-process-{platform}" for platform in PLATFORMS), "first-process-SING", "first-process-torchrun"],
)  # fmt: skip
def test_an_aborted_process_ends_every_node_with_75(platform, aborted, experiment, tmp_path):
    nodes, marker = start_job(platform, experiment, tmp_path)
    os.kill(pid_of(marker, aborted), signal.SIGABRT)  # as NCCL's watchdog ends a process
    codes = end_of_job(nodes, within=TIMEOUT_SECONDS + 30)
    logs = [tmp_path / "logs" / f"node{index}.log" for index in range(2)]
    assert codes == [75, 75], logs_of(tmp_path)
    assert blame_only_node_1(logs[0]), logs_of(tmp_path)
    assert error_line(platform, 1, logs[1]), logs_of(tmp_path)


# Lightning's DDPStrategy configured by its class gets the same strategy and timeouts as "ddp" by name (test_cli.py).
@pytest.mark.parametrize("platform", PLATFORMS)
def test_a_stalled_node_ends_the_others_with_75_within_the_timeout(platform, experiment, tmp_path):
    nodes, _ = start_job(platform, experiment, tmp_path)
    # Every training process of node 1 freezes, its connections open; torchrun's agent goes on, as it
    # would beside a hung GPU driver.
    tree = process_tree(nodes[1].pid)
    for pid in tree[1:] if platform == "torchrun" else tree:
        os.kill(pid, signal.SIGSTOP)
    started = time.monotonic()
    try:
        code: int | str = nodes[0].wait(timeout=TIMEOUT_SECONDS + 30)
    except subprocess.TimeoutExpired:
        code = "hung"
    elapsed = time.monotonic() - started
    end_of_job(nodes, within=0)
    log = logs_of(tmp_path)
    assert code == 75, log
    assert elapsed < TIMEOUT_SECONDS + 30, log
    line = error_line(platform, 0, tmp_path / "logs" / "node0.log")
    assert "node 1 (host" in line and "global ranks 2, 3" in line, log
    assert blame_only_node_1(tmp_path / "logs" / "node0.log"), log


@pytest.mark.parametrize(
    ("platform", "processes", "stuck"),
    [("SING", 2, 2), ("torchrun", 2, 3), ("POD", 1, 1)],
    ids=["SING-a-nodes-first-process", "torchrun-a-nodes-second-process", "POD-the-only-process-of-node-1"],
)
def test_a_process_whose_main_thread_hangs_is_named_and_the_job_ends_with_75(
    platform, processes, stuck, experiment, tmp_path
):
    hang = ["--trainer.callbacks+=trainkit.testing.pacing.HangAtStep", "--trainer.callbacks.rank", str(stuck)]
    nodes, _ = start_job(platform, experiment, tmp_path, *hang, processes=processes)
    started = time.monotonic()
    codes = end_of_job(nodes, within=TIMEOUT_SECONDS + 30)
    elapsed = time.monotonic() - started
    log = "\n".join((tmp_path / "logs" / f"node{index}.log").read_text() for index in range(2))
    assert codes == [75, 75], logs_of(tmp_path)  # a node whose only process hung used to run on forever
    assert elapsed < TIMEOUT_SECONDS + 30, logs_of(tmp_path)
    stuck_at = f"stuck: global rank {stuck} (node 1, host "
    where = "trainkit/testing/pacing.py:"
    survivors = [line for line in log.splitlines() if line.startswith("error: node ") and "lost contact" in line]
    assert len(survivors) == 2 * processes - 1, logs_of(tmp_path)
    assert all(stuck_at in line and where in line for line in survivors), logs_of(tmp_path)
    own_line = f"error: global rank {stuck} is stuck at "
    stack = log.partition(f"The main thread of global rank {stuck}")[2]
    assert own_line in stack and "in on_train_batch_end" in stack, logs_of(tmp_path)


def test_a_hung_process_whose_peers_are_aborted_without_a_roll_call_ends_with_75(experiment, tmp_path):
    """As under NCCL, whose watchdog aborts the processes that wait for a hung one without a word: no roll call
    runs. The hung process, alone on its node, ends once the main node's store is gone and its main thread has
    not moved for a while."""
    hang = ["--trainer.callbacks+=trainkit.testing.pacing.HangAtStep", "--trainer.callbacks.rank", "1"]
    nodes, marker = start_job("POD", experiment, tmp_path, *hang, processes=1)
    time.sleep(2)  # node 1's process hangs after step 5; node 0's waits for it in the next all-reduce
    os.kill(pid_of(marker, 0), signal.SIGABRT)
    codes = end_of_job(nodes, within=30)
    assert codes == [75, 75], logs_of(tmp_path)  # node 1 ran on forever
    stuck = (tmp_path / "logs" / "node1.log").read_text().partition("The main thread of global rank 1")[2]
    assert "error: global rank 1 is stuck at " in stuck and "the main node's store is gone" in stuck, logs_of(tmp_path)
    assert "in on_train_batch_end" in stuck, logs_of(tmp_path)
