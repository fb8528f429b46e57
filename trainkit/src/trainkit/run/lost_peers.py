"""After a process of the job is lost, the survivors ask who is missing, in the main node's store.

Which processes were lost is asked, not guessed from the connection that broke (a survivor's
neighbour often dies of the loss first): the first process that notices a loss reports it in the
store the job formed with, every process that is still alive answers, and those that never answer
are the lost ones. A survivor's main thread may be blocked in a collective that the loss does not
end: gloo's receive waits for the whole timeout even after the peer it waits on gave up, and
neither ending nor aborting a process group frees it. So each process has a thread, `LossWatch`,
that looks for the report every second and answers for it: a process that is alive is never named
as lost, and its main thread stops waiting for the stop agreement at once (`wait_unless_lost`).
A process that is frozen (SIGSTOP) or dead does not answer. One whose main thread hangs (in a device
call, a file read, a deadlock) while its other threads run does answer, but its main thread neither
waits in a collective nor notices the loss as the others' do when their collectives time out: it is
named as stuck, with the line its main thread is at, and its LossWatch ends it with exit 75, as
nothing else would.
"""

import json
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from types import FrameType

import torch.distributed as dist
from torch.distributed import DistError, DistNetworkError

from trainkit.run import own_failures, stopping
from trainkit.run.exit_codes import LOST_NODE
from trainkit.run.job_store import job_store, keys_of_this_attempt, wait_until
from trainkit.run.store_threads import StoreThread

CHECK_SECONDS = 1.0  # how often each process looks for a report of a loss
POLL_SECONDS = 0.001  # how often a process waiting for the stop agreement looks whether it finished
# Answers come within a second or two of a report; a busy machine may need several.
ROLL_CALL_SECONDS = 15.0
QUIET_SECONDS = 4.0
LATE_SECONDS = 5.0  # after the quiet time, for a survivor that noticed the loss late
# Once every process answered, for each one's main thread to notice the loss (its own collective times out
# about when the first one's did); one that does not is stuck.
STUCK_SECONDS = 10.0
# Where a main thread waits for its peers: torch's collectives, and the backward pass (DDP's all-reduce).
WAITING_MODULES = ("torch.distributed", "torch.nn.parallel", "torch.autograd")


@dataclass(frozen=True)
class WhoIsMissing:
    """The roll call's outcome: the processes that did not answer (lost), and those that answered from a
    thread but whose main thread never noticed the loss (stuck), each with where its main thread is."""

    lost: list[int]
    stuck: dict[int, str] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"lost": self.lost, "stuck": self.stuck})

    @classmethod
    def from_json(cls, text: str | bytes) -> "WhoIsMissing":
        found = json.loads(text)
        return cls(found["lost"], {int(rank): where for rank, where in found["stuck"].items()})


class LossReported(DistNetworkError):
    """Another process of the job lost contact with some of the others: this one stopped waiting for them.

    The collective it waited for may still run in gloo's thread until the timeout: its process group
    cannot be ended (that would wait for the collective), only left behind as the process exits.
    """


def _prefix() -> str:
    """Where the roll call after a loss is held in the job's store."""
    return keys_of_this_attempt("lost-contact")


class LossWatch(StoreThread):
    """Looks for a reported loss every CHECK_SECONDS and answers the roll call for this process.

    A process other than the main node's first also reads the list of the missing that the main node
    publishes, so that it can name them even after the main node has ended.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(name="trainkit-loss-watch")
        self.rank, self.world_size = rank, world_size
        self.reported = threading.Event()  # a loss was reported, or the main node's store is gone
        self.answered = threading.Event()  # this process answered the roll call; `missing` is set if it could
        self.missing: WhoIsMissing | None = None
        self.noticed = threading.Event()  # the main thread handles the loss (ask_who_is_missing)
        self.training = threading.Event()  # between the first training step and the end of training

    def run(self) -> None:
        store, prefix = job_store(), _prefix()
        try:
            while not store.check([f"{prefix}/reported"]):
                failure = own_failures.recorded_by_another()
                if failure is not None:  # not a loss: a peer failed with an error of its own, which a retry meets again
                    own_failures.end_with(failure)
                if self.stopping.wait(CHECK_SECONDS):
                    return
        except DistError:  # the main node's store is gone: its node is lost, or it ended
            self.reported.set()
            self._end_if_stuck_alone()
            return
        self.reported.set()
        self.missing = _answer(store, self.rank, self.world_size)
        self.answered.set()
        if self.missing is not None and self.rank in self.missing.stuck and not self.noticed.is_set():
            where = self.missing.stuck[self.rank]
            _end_stuck_process(self.rank, where, "the other processes waited for it until cluster.timeout and gave up")

    def _end_if_stuck_alone(self) -> None:
        """The main node ended without a roll call while this process trains (NCCL's watchdog aborts a process
        without a word). A main thread that neither notices the loss nor waits in a collective, and does not move
        for STUCK_SECONDS, is stuck: nothing else would end it. (After training, a process may wait for its last
        checkpoint's write for minutes after the main node ended.)"""
        seen, since = None, time.monotonic()
        while self.training.is_set() and not (self.noticed.is_set() or self.stopping.wait(0.2)):
            frame = _main_thread_frame()
            now = None if frame is None else (frame, frame.f_lineno)  # the same frame object at the same line
            if now is None or now != seen or _waits(frame):
                seen, since = now, time.monotonic()
            elif time.monotonic() - since > STUCK_SECONDS:
                why = f"the main node's store is gone and its main thread has not moved for {STUCK_SECONDS:.0f} s"
                _end_stuck_process(self.rank, _place_of(frame)["at"], why)


_watch: LossWatch | None = None  # this process's, while it trains with others


def watch_for_losses(rank: int, world_size: int) -> None:
    """Start this process's LossWatch: at the same point on every process, once the job has formed."""
    global _watch
    stop_watching()
    _watch = LossWatch(rank, world_size)
    _watch.start()


def stop_watching() -> None:
    """Stop looking: training ended in step with the others, and the main node may end before this process."""
    if _watch is not None:
        _watch.stop_and_wait()


def training_begins() -> None:
    if _watch is not None:
        _watch.training.set()


def training_ends() -> None:
    if _watch is not None:
        _watch.training.clear()


def wait_unless_lost(work: dist.Work) -> None:
    """Wait for a collective like `work.wait()`, but raise LossReported as soon as a loss was reported.

    Polled, not waited on with a callback: a collective left running must hold nothing of Python's."""
    while not work.is_completed():
        if _watch is not None and _watch.reported.is_set():
            raise LossReported("another process of the job lost contact with the others")
        time.sleep(POLL_SECONDS)
    work.wait()  # raises what the collective raised


def ask_who_is_missing(rank: int, world_size: int) -> WhoIsMissing | None:
    """Who did not answer after the failure, and who is stuck; None when the main node's store is gone too.

    Called by the main thread once it handles the failure. The process group is left as it is: ending
    it would wait for any collective still running, and would not free the processes waiting on this one
    (the model's DDP wrapper keeps it alive).
    """
    if _watch is not None:
        _watch.noticed.set()
        if _watch.answered.is_set():
            return _watch.missing
    store = job_store()
    store.set_timeout(timedelta(seconds=ROLL_CALL_SECONDS))  # not the job's timeout: the main node may be gone
    try:
        store.set(f"{_prefix()}/noticed/{rank}", "")
        store.set(f"{_prefix()}/reported", "")
    except DistError:
        return None
    while _watch is not None and _watch.is_alive() and not _watch.answered.wait(0.2):
        pass  # it answers for this process at its next look, and holds the roll call on the main node
    if _watch is not None and _watch.answered.is_set():
        return _watch.missing
    return _answer(job_store(), rank, world_size)


def _answer(store: dist.Store, rank: int, world_size: int) -> WhoIsMissing | None:
    """Answer the roll call, saying where this process's main thread is; the main node's first process holds it
    and publishes who did not answer and who is stuck."""
    prefix = _prefix()
    try:
        _say_where(store, prefix, rank)
        if rank == 0:
            lost = _collect_answers(store, prefix, world_size)
            if lost:  # give a process that answers late (a busy machine) a little longer
                wait_until(lambda: _answered(store, f"{prefix}/answer", world_size) == world_size, LATE_SECONDS)
                lost = [rank for rank in lost if not store.check([f"{prefix}/answer/{rank}"])]
            found = WhoIsMissing(lost, {} if lost else _stuck(store, prefix, world_size, rank))
            store.set(f"{prefix}/missing", found.to_json())
            # Keep the store open (it lives in this process) until the others have read the answer.
            readers = world_size - len(lost) - 1
            wait_until(lambda: _answered(store, f"{prefix}/read", world_size) >= readers, 5.0)
            return found

        def published() -> bool:
            _say_where(store, prefix, rank)  # its main thread may have moved on, into a collective
            return store.check([f"{prefix}/missing"])

        if wait_until(published, ROLL_CALL_SECONDS + LATE_SECONDS + STUCK_SECONDS):
            found = WhoIsMissing.from_json(store.get(f"{prefix}/missing"))
            store.set(f"{prefix}/read/{rank}", "")
            return found
        return WhoIsMissing(_collect_answers(store, prefix, world_size))  # rank 0 was lost too, or is slow
    except DistError:
        return None


def _collect_answers(store: dist.Store, prefix: str, world_size: int) -> list[int]:
    """Wait until every process answered, or none has for QUIET_SECONDS; the ranks that did not."""
    deadline, quiet_since, answered = time.monotonic() + ROLL_CALL_SECONDS, time.monotonic(), 0
    while time.monotonic() < deadline and time.monotonic() - quiet_since < QUIET_SECONDS:
        now_answered = _answered(store, f"{prefix}/answer", world_size)
        if now_answered == world_size:
            break
        if now_answered > answered:
            answered, quiet_since = now_answered, time.monotonic()
        time.sleep(0.2)
    return [rank for rank in range(world_size) if not store.check([f"{prefix}/answer/{rank}"])]


def _stuck(store: dist.Store, prefix: str, world_size: int, rank: int) -> dict[int, str]:
    """Every process answered: those whose main thread neither notices the loss in time nor waits for its peers in
    a collective (one that began late notices later), and the line each one's main thread is at."""

    def all_noticed() -> bool:
        _say_where(store, prefix, rank)
        return _answered(store, f"{prefix}/noticed", world_size) == world_size

    wait_until(all_noticed, STUCK_SECONDS)
    stuck = {}
    for other in range(world_size):
        if not store.check([f"{prefix}/noticed/{other}"]):
            place = json.loads(store.get(f"{prefix}/answer/{other}"))
            if not place["waiting"]:
                stuck[other] = place["at"]
    return stuck


def _say_where(store: dist.Store, prefix: str, rank: int) -> None:
    """This process's answer to the roll call: where its main thread is now."""
    store.set(f"{prefix}/answer/{rank}", json.dumps(_main_thread_place()))


def _main_thread_place() -> dict[str, str | bool]:
    """The innermost line the main thread runs (`/src/model.py:42 in training_step`), and whether it waits there."""
    frame = _main_thread_frame()
    if frame is None:
        return {"at": "an unknown place", "waiting": False}
    return _place_of(frame)


def _main_thread_frame() -> FrameType | None:
    """The frame the main thread runs now (None once it has ended)."""
    return sys._current_frames().get(threading.main_thread().ident)


def _place_of(frame: FrameType) -> dict[str, str | bool]:
    at = f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
    return {"at": at, "waiting": _waits(frame)}


def _waits(frame: FrameType) -> bool:
    return frame.f_globals.get("__name__", "").startswith(WAITING_MODULES)


def _end_stuck_process(rank: int, where: str, why: str) -> None:
    """This process's main thread is stuck, and nothing else would end it: its stack goes to the log, then the
    process ends with exit 75."""
    frame = _main_thread_frame()
    stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
    stopping.exit_now(
        LOST_NODE,
        f"The main thread of global rank {rank}, which the other processes of the job waited for:\n{stack}"
        f"error: global rank {rank} is stuck at {where}: {why}; exiting with {LOST_NODE} so that the job is retried",
    )


def _answered(store: dist.Store, prefix: str, world_size: int) -> int:
    return sum(store.check([f"{prefix}/{rank}"]) for rank in range(world_size))
