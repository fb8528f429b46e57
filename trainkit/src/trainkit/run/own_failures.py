"""A process that fails with an error of its own tells the others, which end with its status, not as a lost node.

Without this, the other processes of the job lose a peer and exit 75, which every platform retries
(Slurm requeues the job, POD replaces the pod without counting it): a bug that only one process's
data meets, or one in code that only global rank 0 runs, would be met again by every retry. The
failed process records what failed in the job's store as it ends (run/diagnostics.py); every other
process finds the record (its watch thread looks every second, its main thread looks when a
collective fails first) and ends at once, with the failed process's status and a line naming it.
The store lives in global rank 0: whether that process failed or found the record, it waits until
the others have read the record before it ends.
"""

import contextlib
import json
import socket
import threading
import time
from dataclasses import asdict, dataclass
from typing import NoReturn

import torch.distributed as dist
from torch.distributed import DistError

from trainkit.run import stopping
from trainkit.run.job_store import job_store, keys_of_this_attempt, wait_until
from trainkit.run.placement import Placement

READ_SECONDS = 10.0  # how long global rank 0 keeps the store up for the others to read a failure


@dataclass(frozen=True)
class Failure:
    """Which process failed, where, with what error (its first line), and the status it ends with."""

    global_rank: int
    node_rank: int
    host: str
    error: str
    status: int

    def line(self, global_rank: int) -> str:
        """The line another process (`global_rank`) ends with."""
        return (
            f"error: global rank {self.global_rank} (node {self.node_rank}, host {self.host}) failed with"
            f" {self.error}: its log has the traceback. Global rank {global_rank} ends with it, exiting with"
            f" {self.status}: a retry would meet the same error"
        )


_here: Placement | None = None  # this process's place in the job, once the job has formed
_world_size = 0
_recorded_here = False  # this process failed, and recorded it: it ends with its own error
_one_ending = threading.Lock()  # the main thread and a watch thread may both find the record


def job_formed(node_rank: int, global_rank: int, world_size: int) -> None:
    """From now on a failure of this process is told to the others (called by the strategies once the group formed)."""
    global _here, _world_size
    _here, _world_size = Placement(node_rank, global_rank, socket.gethostname()), world_size


def tell_the_others(error: BaseException, status: int) -> None:
    """This process ends with `status` after `error`, an error of its own: record it in the job's store for the
    other processes; global rank 0 then waits until they have read it. Does nothing outside a job."""
    global _recorded_here
    if _here is None or _world_size < 2 or not dist.is_initialized():
        return
    stopping.end_on_own_terms()  # the processes started here end on reading it: no failure of theirs to end us for
    _recorded_here = True
    first_line = (str(error).strip().splitlines() or [""])[0][:300]
    failure = Failure(_here.global_rank, _here.node_rank, _here.host, f"{type(error).__name__}: {first_line}", status)
    with contextlib.suppress(DistError):  # the store is gone (its node was lost): the others find that out
        store = job_store()
        store.set(_key("by", failure.global_rank), json.dumps(asdict(failure)))
        store.set(_key("any"), "")
        if failure.global_rank == 0:
            _wait_for_readers(store)


def recorded_by_another() -> Failure | None:
    """The failure another process of the job recorded (the lowest global rank's, if several), or None."""
    if _recorded_here or _here is None or not dist.is_initialized():
        return None
    try:
        store = job_store()
        if not store.check([_key("any")]):
            return None
        for rank in range(_world_size):
            if store.check([_key("by", rank)]):
                return Failure(**json.loads(store.get(_key("by", rank))))
    except DistError:
        return None
    return None


def end_with(failure: Failure) -> NoReturn:
    """End this process with the failed one's status and a line naming it, once the record is read."""
    assert _here is not None, "only a process of a job finds another's failure"
    if not _one_ending.acquire(blocking=False):
        while True:  # another thread of this process is ending it (stopping.exit_now)
            time.sleep(60)
    stopping.end_on_own_terms()  # torchrun stops a node's other processes once one ended: this one says why first
    with contextlib.suppress(DistError):
        store = job_store()
        store.set(_key("read", _here.global_rank), "")
        if _here.global_rank == 0:
            _wait_for_readers(store)
    stopping.exit_now(failure.status, failure.line(_here.global_rank))


def _wait_for_readers(store: dist.Store) -> None:
    """Until every other process has read the record or recorded a failure of its own, up to READ_SECONDS."""

    def all_read() -> bool:
        others = range(1, _world_size)
        return all(store.check([_key("read", rank)]) or store.check([_key("by", rank)]) for rank in others)

    wait_until(all_read, READ_SECONDS)


def _key(*parts: object) -> str:
    return "/".join(map(str, (keys_of_this_attempt("failed"), *parts)))
