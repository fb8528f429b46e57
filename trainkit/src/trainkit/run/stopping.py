"""Stop on SIGTERM or SIGINT at any moment, from train.py's first line to the last step, leaving no process behind.

Platforms stop a job with SIGTERM (Kubernetes, Docker, Slurm's scancel and time limit); Ctrl-C sends
SIGINT to every process of the terminal's foreground job. What happens then:

- While training, `PreemptionCheckpoint` (checkpointing.py) stops every process at the same step, saves
  `checkpoints/preempted.ckpt` and exits with 143 after SIGTERM, 130 after SIGINT (run/exit_codes.py).
- At any other moment (imports, data preparation, forming the job, the sanity check, after the last
  step) there is nothing to save: the process exits at once with the same status, even while it waits in
  C code for another node, and so do the processes Lightning started on this node.
- Processes forked from this one, data loader workers among them, stop only when this process asks
  them to: Slurm and Ctrl-C signal them too, and a worker that died first would fail the training
  process before it saves. The training process ends them when it stops.

train.py installs the handlers on its first lines: as PID 1 in a container, the kernel drops every
signal a process has no handler for, and `docker stop` would wait out its grace period.
"""

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import NoReturn

from trainkit.run.exit_codes import INTERRUPTED, PREEMPTED

EXIT_STATUS = {signal.SIGTERM: PREEMPTED, signal.SIGINT: INTERRUPTED}
SIGNAL_NAME = {status: signum.name for signum, status in EXIT_STATUS.items()}
STARTED_PROCESSES_WAIT_SECONDS = 10  # for the processes Lightning started to stop before they are killed
EXIT_SECONDS = 5  # for exit_now to end the loader's workers and flush the output, after those processes ended

_requested = 0  # the exit status the signals received so far ask for; 0 while none came
_on_signal: Callable[[], None] | None = None  # set while training: PreemptionCheckpoint stops and saves
_started_processes: Callable[[], Iterable[subprocess.Popen]] = list
_watching = False
_ending = False  # the process ends with a status of its own, and says why first
_exit_under_way = False  # a thread other than the main one ends the process, or is about to (exit_now)


def handle_stop_signals() -> None:
    """Handle SIGTERM and SIGINT in this process from now on; again after Lightning replaced the handlers.

    Python runs a signal handler only between bytecodes of the main thread, which may wait in C code for
    minutes (for other nodes to join). The C-level handler also writes the signal's number to a pipe,
    which a thread of this module reads at once.
    """
    global _watching
    for signum in EXIT_STATUS:
        signal.signal(signum, _handle)
    if _watching:
        return
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    threading.Thread(target=_watch, args=(read_end,), name="stop-signals", daemon=True).start()
    os.register_at_fork(after_in_child=_obey_only_the_parent)
    _watching = True


def stop_requested() -> int:
    """The exit status that the signals received ask for (143 for SIGTERM, 130 for SIGINT), 0 if none came."""
    return _requested


def stop_with_this_process(processes: Callable[[], Iterable[subprocess.Popen]]) -> None:
    """Pass every stop signal on to these processes (those Lightning starts on this node), and wait for them."""
    global _started_processes
    _started_processes = processes


def save_before_stopping(on_signal: Callable[[], None]) -> None:
    """Training has begun: from now on a signal only calls `on_signal` (in the main thread) and the caller stops."""
    global _on_signal
    handle_stop_signals()  # Lightning's SIGTERM handler would broadcast from rank 0 inside the handler
    _on_signal = on_signal


def stop_at_once() -> None:
    """Nothing more to save: from now on a signal ends the process at once."""
    global _on_signal
    _on_signal = None


def end_on_own_terms() -> None:
    """The process is already ending with a status of its own (75 after a lost peer) and says why first: a stop
    signal no longer ends it at once. torchrun, for one, stops the other processes of a node as soon as one
    exits, before they wrote the line naming the lost node. The ending is bounded (the roll call), and the
    platform's SIGKILL after its grace period still ends the process. Ignored, not handled: Python puts a
    handled signal back to its default while the process exits, and a SIGTERM then would end it with 143.
    From another thread (which can set no handler) the process must end with `os._exit`, not Python's exit."""
    global _ending
    _ending = True
    if threading.current_thread() is threading.main_thread():
        for signum in EXIT_STATUS:
            signal.signal(signum, signal.SIG_IGN)


def ending() -> bool:
    """Whether the process is ending with a status of its own (`end_on_own_terms`)."""
    return _ending


def _handle(signum: int, frame: object) -> None:
    # The main thread's part, at its next bytecode; the thread reading the pipe acts too, perhaps only later.
    global _exit_under_way
    if _on_signal is not None:
        _on_signal()
    elif not _ending:
        _exit_under_way = True  # that thread ends the process (_stop): what fails here meanwhile is its doing


def _watch(read_end: int) -> None:
    while True:
        for signum in os.read(read_end, 64):
            if signum in EXIT_STATUS:
                _stop(signal.Signals(signum))


def _stop(signum: signal.Signals) -> None:
    global _requested, _ending, _exit_under_way
    _requested = max(_requested, EXIT_STATUS[signum])
    exiting_now = _on_signal is None and not _ending
    # Before the processes Lightning started exit with the same status: its watcher, which would end this
    # process for that, spares a process that is ending on its own (run/node_watch.py), and so does the main
    # thread when a collective it waits in fails because they left (let_an_exit_under_way_finish).
    _ending = _ending or exiting_now
    _exit_under_way = _exit_under_way or exiting_now
    for process in _started_processes():
        if process.poll() is None:
            process.send_signal(signum)
    if exiting_now:
        _exit_now(signum)


def _exit_now(signum: signal.Signals) -> None:
    status = EXIT_STATUS[signum]
    exit_now(status, f"{signum.name}: nothing to save yet, exiting with status {status}")


def exit_now(status: int, line: str) -> NoReturn:
    """Write `line`, wait a little for the processes Lightning started here, end any left and the loader's
    workers, and exit with `status`: from any thread, the main one perhaps waiting in C code."""
    global _ending, _exit_under_way
    _ending = _exit_under_way = True
    os.write(2, f"{line}\n".encode())
    deadline = time.monotonic() + STARTED_PROCESSES_WAIT_SECONDS
    for process in _started_processes():
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            process.kill()
    for child in multiprocessing.active_children():  # data loader workers, which wait for this process to end them
        child.kill()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def let_an_exit_under_way_finish() -> None:
    """For the main thread, on an error: if another thread is ending the process (`exit_now`), the error is what
    that exit caused, for one a collective that failed because the processes Lightning started here left on the
    same stop signal. That thread's status and line stand, not the error's (exit 75 for a lost peer): wait for it to
    end the process. Returns only if it has not within the time its exit may take."""
    if _exit_under_way:
        time.sleep(STARTED_PROCESSES_WAIT_SECONDS + EXIT_SECONDS)


def _obey_only_the_parent() -> None:
    # In a forked child (a data loader worker): the parent reads the pipe, not the child. torch
    # replaces a worker's SIGTERM handler, but not its signal mask: the signals wait for a thread.
    # Programs a worker starts inherit the mask too.
    signal.set_wakeup_fd(-1)
    signal.pthread_sigmask(signal.SIG_BLOCK, EXIT_STATUS)
    threading.Thread(target=_wait_for_the_parent, args=(os.getppid(),), name="stop-signals", daemon=True).start()


def _wait_for_the_parent(parent: int) -> None:
    while True:
        if signal.sigwaitinfo(EXIT_STATUS).si_pid == parent:  # the loader shutting its workers down
            os._exit(0)
        # Anyone else (Slurm, a terminal's Ctrl-C, kill -TERM -<pgid>) signalled the parent too.
