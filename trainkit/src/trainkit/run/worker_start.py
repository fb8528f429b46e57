"""A forked process (a data loader worker) that never starts ends the job with one line and exit 75, not a hang.

Every training process has threads when its loader forks workers (the kit's stop-signals watcher,
gloo's, wandb's). A fork copies only the thread that called it: a lock another thread held at that
moment stays held in the child, and a child that needs it waits forever inside `os.fork()`, before
any of its own code runs. Its parent then waits on the loader's queue until the platform kills the
job, and the same job may hang again on its restart.

So each fork is counted in the parent, and each child says it arrived as the last thing it does
after the fork (a pid written to a pipe: no lock involved). A fork whose child has not arrived
within WORKER_START_SECONDS ends this process with exit 75 (exit_codes.LOST_NODE: retried, it
resumes), naming the child; the other processes of the job then lose this one and end with 75 too.

Before that, the stuck child prints where it waits: every fork hands its child Python's fault
handler on SIGUSR2 (a C-level handler, which runs however stuck the child's Python is), the child
gives it up once it has arrived, and the watchdog sends a child that has not SIGUSR2. The stack
(and those of the threads that were alive at the fork) says which lock was held, and by what.
"""

import contextlib
import faulthandler
import os
import platform
import select
import signal
import sys
import threading
import time
from pathlib import Path

from trainkit.run.exit_codes import LOST_NODE
from trainkit.run.processes import children_of

WORKER_START_SECONDS = 60.0  # a fork of a large process copies its page tables: seconds, never a minute
STACK_SIGNAL = signal.SIGUSR2  # a stuck child prints its stack on it
STACK_SECONDS = 1.0  # for a stuck child to print its stack
FORK_BUG = "CPython issue 112275, fixed in 3.11.10 and 3.12"
NOT_STARTED = "did not start within"  # in the line that ends the job (testing/runs.py looks for it)

_fork_times: list[float] = []  # when this process forked, oldest first
_arrived: set[int] = set()  # the children that said they started
_write_end = -1


def watch_worker_starts() -> None:
    """From now on, a process forked from this one that does not start in time ends this one with exit 75."""
    global _write_end
    read_end, _write_end = os.pipe()
    os.register_at_fork(before=_count_fork, after_in_parent=_keep_stack_signal, after_in_child=_say_arrived)
    threading.Thread(target=_watch, args=(read_end,), name="worker-starts", daemon=True).start()


def _count_fork() -> None:
    _fork_times.append(time.monotonic())
    faulthandler.register(STACK_SIGNAL, file=2, all_threads=True)  # the child prints its stack to stderr


def _keep_stack_signal() -> None:
    faulthandler.unregister(STACK_SIGNAL)  # SIGUSR2 means to the parent what it meant before the fork


def _say_arrived() -> None:
    # Registered after the kit's other fork hooks (run/stopping.py), so this runs once they have run.
    os.write(_write_end, os.getpid().to_bytes(4, "little"))
    faulthandler.unregister(STACK_SIGNAL)
    _fork_times.clear()  # the child counts its own forks only
    _arrived.clear()


def _watch(read_end: int) -> None:
    pending = b""
    while True:
        if select.select([read_end], [], [], 1.0)[0]:
            pending += os.read(read_end, 4096)
            while len(pending) >= 4:
                _arrived.add(int.from_bytes(pending[:4], "little"))
                pending = pending[4:]
        waiting = len(_fork_times) - len(_arrived)
        if waiting > 0 and time.monotonic() - _fork_times[len(_arrived)] > WORKER_START_SECONDS:
            _end_the_job(_not_arrived())


def _not_arrived() -> list[int]:
    """The children of this process forked from it (not started as programs) that never said they arrived."""
    return [pid for pid in children_of(os.getpid()) if pid not in _arrived and _forked(pid)]


def _forked(pid: int) -> bool:
    """A forked child has this process's command and environment; a program it started has its own (the
    processes Lightning starts run the same command, with LOCAL_RANK added)."""
    try:
        return all(Path(f"/proc/{pid}/{part}").read_bytes() == Path(f"/proc/self/{part}").read_bytes()
                   for part in ("cmdline", "environ"))  # fmt: skip
    except OSError:
        return False  # ended meanwhile


def _print_stacks(hung: list[int]) -> None:
    """Have each stuck child print its stack to stderr, below a line that says whose it is."""
    for pid in hung:
        print(f"the stack of data loader worker {pid}, stuck in its fork:", file=sys.stderr, flush=True)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, STACK_SIGNAL)
            time.sleep(STACK_SECONDS)


def fork_can_hang(version: tuple[int, int, int] = sys.version_info[:3]) -> bool:
    """Whether this Python's own fork can hang the child: CPython issue 112275, in 3.11 before 3.11.10. The child
    waits forever for the interpreter's thread-state lock if another thread held it at the fork; gloo's and NCCL's
    threads take it (without Python's GIL) whenever they drop the last reference to a finished collective."""
    return version[:2] == (3, 11) and version < (3, 11, 10)


def python_named() -> str:
    """E.g. `Python 3.11.7`."""
    return f"Python {platform.python_version()}"


def stuck_fork_warning(world_size: int, loader_workers: int) -> str | None:
    """One line for a job of several processes whose loaders fork workers on such a Python; None otherwise."""
    if not fork_can_hang() or world_size < 2 or loader_workers == 0:
        return None
    return (
        f"{python_named()} can leave a data loader worker hung in its fork while the job's collectives run"
        f" ({FORK_BUG}): use a newer Python. Such a job ends with {LOST_NODE} within a minute, to be retried"
    )


def _end_the_job(hung: list[int]) -> None:
    which = f"pid {', '.join(map(str, hung))}" if hung else "its pid is unknown"
    sys.stdout.flush()
    _print_stacks(hung)
    python = (
        f"; {python_named()} has such a lock in its own fork ({FORK_BUG}): use a newer Python"
        if fork_can_hang()
        else ""
    )
    print(
        f"error: a data loader worker of this process (pid {os.getpid()}) {NOT_STARTED}"
        f" {WORKER_START_SECONDS:.0f} s of its fork ({which}), probably stuck on a lock another thread held when it"
        f" was forked{python}; exiting with {LOST_NODE} so that the job is retried",
        file=sys.stderr,
        flush=True,
    )
    for pid in hung:
        os.kill(pid, signal.SIGKILL)
    os._exit(LOST_NODE)
