"""The parent of each training process: an abort means a peer was lost, and the job is retried (exit 75).

Under NCCL, a collective whose peer died, stalled or outlasted `cluster.timeout` does not raise in
Python: NCCL's watchdog thread ends the process with SIGABRT (exit 134, TORCH_NCCL_ASYNC_ERROR_HANDLING
at torch's default, 3). A scheduler reads 134 as a crash and does not requeue it. So the command a
platform or launcher starts (a container's command, each torchrun worker, each srun task) runs the
training in a child process and only waits for it: it passes SIGTERM and SIGINT on, and ends as the
child ended, except that an abort becomes exit 75 (run/exit_codes.py) with one line saying why.

The child's own children (the processes Lightning starts on a node, data loader workers) are
adopted by this process if the child dies first (a subreaper), so the node ends only once all of
them have, within STRAGGLERS_WAIT_SECONDS.
"""

import ctypes
import os
import signal
import subprocess
import sys
import time

from trainkit.run.exit_codes import LOST_NODE
from trainkit.run.processes import children_of

SUPERVISED = "TRAINKIT_SUPERVISED"  # set in the training process and inherited by every process it starts
FORWARDED = (signal.SIGTERM, signal.SIGINT)
STRAGGLERS_WAIT_SECONDS = 30  # for the processes the child started to end after it (a peer's timeout, a save)
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36  # linux/prctl.h


def supervise() -> None:
    """In the process a platform started: run this command again as a child, wait, and exit as it did.

    Returns at once in the child (and in every process it starts), which goes on to train.
    """
    if os.environ.get(SUPERVISED) or sys.platform != "linux":
        return
    os.environ[SUPERVISED] = "1"
    _become_subreaper()
    child: subprocess.Popen | None = None
    received: list[int] = []

    def forward(signum: int, frame: object) -> None:
        if child is None:
            received.append(signum)  # passed on once the child exists
        elif child.poll() is None:
            child.send_signal(signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    # The child never outlives this process: a SIGKILL here (a launcher's, the OOM killer's) ends it too.
    child = subprocess.Popen([sys.executable, *sys.orig_argv[1:]], preexec_fn=_die_with_the_parent)
    for signum in received:
        child.send_signal(signum)
    status = child.wait()
    _wait_for_stragglers()
    sys.stdout.flush()
    if status == -signal.SIGABRT or status == 128 + signal.SIGABRT:
        print(aborted_line(), file=sys.stderr, flush=True)
        os._exit(LOST_NODE)
    if status < 0:  # end the way the child ended, as a shell and a scheduler would have seen it
        if -status not in (signal.SIGKILL, signal.SIGSTOP):  # the two a process cannot handle
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
        status = 128 - status  # as PID 1 of a container the kernel drops it: the status a shell would report
    os._exit(status)


def aborted_line() -> str:
    dumps = os.environ.get("TORCH_FR_DUMP_TEMP_FILE", "/tmp/nccl_trace_rank_")
    return (
        "error: the training process was aborted (SIGABRT), as NCCL's watchdog ends a process whose collective"
        " failed or outlasted cluster.timeout: a peer stopped answering (see the other nodes' logs; each"
        f" process's last collectives are in {dumps}<rank>); exiting with 75 so that the job is retried"
    )


def _become_subreaper() -> None:
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _die_with_the_parent() -> None:
    # In the child between fork and exec (this process has no other thread: nothing to deadlock on).
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _wait_for_stragglers() -> None:
    """Reap the processes left behind by the child; kill those still running after STRAGGLERS_WAIT_SECONDS."""
    deadline = time.monotonic() + STRAGGLERS_WAIT_SECONDS
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return  # none left
        if pid == 0:
            time.sleep(0.1)
    for pid in children_of(os.getpid()):
        os.kill(pid, signal.SIGKILL)
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return
