"""The node's first process watches the processes Lightning started beside it; a lost peer ends the node with 75.

Lightning's own watcher SIGKILLs the whole node, the first process too, as soon as one of them
exits non-zero: the platform then sees 137 and does not retry. When the one that ended was aborted
(NCCL's watchdog, SIGABRT) or exited 75 (it lost a peer, run/diagnostics.py), the node ends the
others and exits 75 itself, with one line saying so. Any other failure keeps Lightning's behaviour.

While this process ends with a status of its own (a stop signal before training, a lost peer), the
processes it started exit first, and the watch leaves them to it.

A process that exited 75 lost peers of the whole job, and this one is losing them too: it is given
until the job's timeout to notice, so that it names the lost node itself (on its own, a collective
with a lost peer ends within that timeout).
"""

import os
import signal
import subprocess
import sys
from datetime import timedelta

from lightning.fabric.strategies.launchers import subprocess_script as fabric_launcher
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.pytorch.strategies.launchers import subprocess_script as pytorch_launcher

from trainkit.run import own_failures, stopping
from trainkit.run.exit_codes import INTERRUPTED, LOST_NODE, PREEMPTED
from trainkit.run.job_store import wait_until
from trainkit.run.lost_peers import LATE_SECONDS, ROLL_CALL_SECONDS, STUCK_SECONDS

LOST_PEER = {-signal.SIGABRT, 128 + signal.SIGABRT, LOST_NODE}  # how a process that lost a peer ends
STOPPED = {PREEMPTED, INTERRUPTED}  # how a process that a stop signal ended exits
POLL_SECONDS = 1


def failed_on_its_own(started: list[subprocess.Popen]) -> subprocess.Popen | None:
    """The first of the processes Lightning started on this node that exited with an error of its own (1: a bug, 2: a
    setting): not a lost peer, a stop signal, or a kill. A retry would meet it again, so the node ends with its
    status, not 75."""
    for process in started:
        status = process.returncode
        if status is not None and status > 0 and status not in LOST_PEER | STOPPED:
            return process
    return None


def say_it_failed(failed: subprocess.Popen, started: list[subprocess.Popen]) -> str:
    """The line naming a process Lightning started here that failed on its own, by its ranks."""
    local_rank = started.index(failed) + 1  # Lightning starts local ranks 1, 2, ... in order, and sets NODE_RANK
    global_rank = int(os.environ.get("NODE_RANK", 0)) * (len(started) + 1) + local_rank
    return (
        f"error: global rank {global_rank} (local rank {local_rank}, pid {failed.pid}) failed with exit"
        f" {failed.returncode}: its error is above; ending this node's processes, exiting with {failed.returncode}"
    )


def status_after(error: BaseException) -> int:
    """How a node ends after `error` cut it off from its peers: with the status of a process it started that failed
    on its own (run/diagnostics.py notes it on the error), else LOST_NODE."""
    return getattr(error, "trainkit_status", LOST_NODE)


def watch_started_processes(timeout: timedelta) -> None:
    """From now on, the processes Lightning starts on this node are watched by `StartedProcessesWatch`.

    `timeout` is the job's (cluster.timeout): how long a collective waits for a peer that stopped answering.
    """
    notice_seconds = timeout.total_seconds() + ROLL_CALL_SECONDS + LATE_SECONDS + STUCK_SECONDS

    def start_watch(child_processes: list[subprocess.Popen]) -> None:
        StartedProcessesWatch(os.getpid(), child_processes, POLL_SECONDS, notice_seconds).start()

    pytorch_launcher._launch_process_observer = start_watch  # Lightning has no public hook for its watcher
    fabric_launcher._launch_process_observer = start_watch


class StartedProcessesWatch(_ChildProcessObserver):
    """Lightning's watcher, except that a process that lost a peer ends the node with exit 75.

    It reads the launcher's list of processes, which the kit empties when this process handles the
    failure itself (a preemption, a lost peer seen here first).
    """

    def __init__(
        self, main_pid: int, child_processes: list[subprocess.Popen], sleep_period: float, notice_seconds: float
    ) -> None:
        super().__init__(main_pid, child_processes, sleep_period)
        self.notice_seconds = notice_seconds  # for this process to notice a loss that a started one reported

    def _run(self) -> bool:
        for process in self._child_processes:
            process.poll()
        lost = [process for process in self._child_processes if process.returncode in LOST_PEER]
        if not lost:
            # This process is ending with a status of its own and waits for these itself (run/stopping.py): after
            # a stop signal before training they exit 143 first, which is no failure to end the node for.
            if stopping.ending():
                return True
            failed = failed_on_its_own(self._child_processes)
            if failed is not None:
                failure = own_failures.recorded_by_another()
                if failure is not None:  # it ended on reading that another process of the job failed
                    own_failures.end_with(failure)
                self._end_node(failed)
            return super()._run()
        named_the_loss = all(process.returncode == LOST_NODE for process in lost)
        # This process, a survivor of the same loss, begins ending on its own (run/diagnostics.py) in that time.
        if named_the_loss and wait_until(stopping.ending, self.notice_seconds):
            return True  # with 75 and the line naming the lost node, after waiting for the others
        for process in self._child_processes:
            if process.returncode is None:
                process.kill()
        status = lost[0].returncode
        how = "was aborted (SIGABRT)" if status in (-signal.SIGABRT, 128 + signal.SIGABRT) else f"exited with {status}"
        sys.stdout.flush()
        print(
            f"error: the process Lightning started on this node as pid {lost[0].pid} {how}: it lost a peer;"
            f" ending this node's processes, exiting with {LOST_NODE} so that the job is retried",
            file=sys.stderr,
            flush=True,
        )
        os._exit(LOST_NODE)

    def _end_node(self, failed: subprocess.Popen) -> None:
        """End the node with the status of a process it started that failed on its own, naming it."""
        for process in self._child_processes:
            if process.returncode is None:
                process.kill()
        sys.stdout.flush()
        print(say_it_failed(failed, self._child_processes), file=sys.stderr, flush=True)
        os._exit(failed.returncode)
