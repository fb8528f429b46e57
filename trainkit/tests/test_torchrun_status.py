"""`python -m trainkit.cluster.torchrun`: torchrun, ending with the training's exit status instead of 1.

Real torchrun runs, with workers that end with each status (the training itself runs under it in
test_lost_peers.py and the generated project's torchrun scripts).
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from trainkit.cluster.torchrun import job_status, rendezvous_endpoint
from trainkit.run.exit_codes import CANNOT_WRITE, CONFIG_ERROR, INTERRUPTED, LOST_NODE, PREEMPTED

from .helpers import clean_env, free_port

# A worker per rank: STATUSES[rank] is its exit status; "wait" waits for SIGTERM and exits 143, as
# training does after its checkpoint; "kill" dies of SIGKILL. Lower ranks end first. Each worker
# touches started-<rank> in the working directory first.
FAKE_WORKER = textwrap.dedent("""\
    import os, signal, sys, time
    rank = int(os.environ["RANK"])
    status = os.environ["STATUSES"].split(",")[rank]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    open(f"started-{rank}", "w").close()
    time.sleep(0.5 * rank)
    if status == "wait":
        time.sleep(120)
    if status == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(int(status))
""")


ONE_NODE = ("--standalone", "--nproc-per-node", "2")


def start_torchrun(tmp_path: Path, statuses: str, *options: str, log: str = "") -> subprocess.Popen:
    """The wrapper around torchrun with `options`, in `tmp_path`, its output in the file `log` or a pipe."""
    worker = tmp_path / "worker.py"
    worker.write_text(FAKE_WORKER)
    command = [sys.executable, "-m", "trainkit.cluster.torchrun", *options, str(worker)]
    output = open(tmp_path / log, "w") if log else subprocess.PIPE  # noqa: SIM115 (the child writes it)
    return subprocess.Popen(command, cwd=tmp_path, env=clean_env(STATUSES=statuses), stdout=output,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip


# (workers' statuses, the wrapper's status, with --swarm). torchrun alone exits 1 in every case.
WORKER_CASES = {
    "config error; torchrun stops the other": ("2,wait", CONFIG_ERROR, 0),
    "lost node; torchrun stops the other": ("wait,75", LOST_NODE, LOST_NODE),
    "a crash, its peer lost it": ("1,75", 1, 1),
    "preempted, both": ("143,143", PREEMPTED, PREEMPTED),
    "killed (out of memory)": ("kill,wait", 137, 137),
    "finished": ("0,0", 0, 0),
}


@pytest.mark.parametrize("case", WORKER_CASES)
def test_exits_with_the_workers_status(tmp_path, case):
    statuses, expected, swarm_expected = WORKER_CASES[case]
    # Plain and --swarm at once: they are independent runs (2 processes each).
    (tmp_path / "plain").mkdir()
    (tmp_path / "swarm").mkdir()
    runs = {"plain": start_torchrun(tmp_path / "plain", statuses, *ONE_NODE),
            "swarm": start_torchrun(tmp_path / "swarm", statuses, "--swarm", *ONE_NODE)}  # fmt: skip
    outputs = {name: run.communicate(timeout=180)[0] for name, run in runs.items()}
    assert runs["plain"].returncode == expected, outputs["plain"][-3000:]
    assert runs["swarm"].returncode == swarm_expected, outputs["swarm"][-3000:]
    if swarm_expected != expected:
        assert "exiting 0 so that Swarm does not restart the task" in outputs["swarm"]
    assert "Traceback" not in outputs["plain"], outputs["plain"][-3000:]


@pytest.mark.parametrize(
    ("statuses", "expected"),
    [([LOST_NODE, CONFIG_ERROR], CONFIG_ERROR), ([1, CONFIG_ERROR], CONFIG_ERROR), ([LOST_NODE, 1], 1),
     ([PREEMPTED, LOST_NODE], LOST_NODE), ([PREEMPTED, 137], 137), ([PREEMPTED, PREEMPTED], PREEMPTED),
     ([CANNOT_WRITE, LOST_NODE], CANNOT_WRITE)],
)  # fmt: skip
def test_names_the_cause_not_its_echoes(statuses, expected):
    """Failures torchrun reports together, in any order: more than two workers fail only on bigger nodes."""
    assert job_status(statuses) == expected
    assert job_status(statuses[::-1]) == expected


@pytest.mark.parametrize(("sent", "expected"), [(signal.SIGTERM, PREEMPTED), (signal.SIGINT, INTERRUPTED)])
def test_stopped_by_a_signal(tmp_path, sent, expected):
    run = start_torchrun(tmp_path, "wait,wait", *ONE_NODE)
    try:
        wait_for_files(tmp_path, ["started-0", "started-1"], run)
        run.send_signal(sent)
        output = run.communicate(timeout=60)[0]
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == expected, output[-3000:]


def test_losing_the_node_that_hosts_the_rendezvous_is_a_lost_node(tmp_path):
    """The first node's torchrun hosts the rendezvous store; when that node dies, the others' torchrun
    raises instead of reporting its workers: still 75 (requeue), with a line naming the endpoint."""
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = []
    for rank in range(2):
        (tmp_path / f"node{rank}").mkdir()
        options = ["--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", endpoint, "--rdzv-id", "lost-host",
                   "--rdzv-conf", f"is_host={int(rank == 0)}"]  # fmt: skip
        nodes.append(start_torchrun(tmp_path / f"node{rank}", "wait,wait,wait,wait", *options, log=f"node{rank}.log"))
    try:
        wait_for_files(tmp_path / "node1", ["started-2", "started-3"], nodes[1])
        os.killpg(nodes[0].pid, signal.SIGKILL)  # the whole first node: its torchrun and its workers
        code = nodes[1].wait(timeout=90)
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
            node.wait()
    log = (tmp_path / "node1" / "node1.log").read_text()
    assert code == LOST_NODE, log[-3000:]
    assert f"error: torchrun cannot reach its rendezvous store at {endpoint}" in log, log[-3000:]


def test_reads_the_rendezvous_endpoint_in_either_spelling():
    assert rendezvous_endpoint(["--nnodes=2", "--rdzv-endpoint", "head:29500", "train.py"]) == "head:29500"
    assert rendezvous_endpoint(["--rdzv_endpoint=head:29500", "train.py"]) == "head:29500"
    assert rendezvous_endpoint(["--standalone", "train.py"]) == ""


def wait_for_files(folder: Path, names: list[str], run: subprocess.Popen, within: float = 60) -> None:
    deadline = time.monotonic() + within
    while not all((folder / name).exists() for name in names):
        assert run.poll() is None, f"torchrun ended with {run.returncode} before its workers started"
        assert time.monotonic() < deadline, f"no {names} in {folder} after {within} s"
        time.sleep(0.1)
