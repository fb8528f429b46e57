"""While the job prepares its data, a node that stops answering ends the others with 75, as it would in training.

Lightning waits for every process around `prepare_data` in a barrier with no timeout (a download on
one node may take hours), so a node frozen there (stopped, its machine paused, its network cut while
the connections stay open) would hold the others until someone cancels the job. While the job
prepares data, a thread in each process adds a sign of life to the job's store every second: a
download in the main thread does not stop it, a frozen process does. The main node's first process
names those silent for `cluster.timeout` and publishes the line; every process then ends with 75 and
that line. The others watch the main node's signs of life in the same way, and the store itself (it
lives on the main node) fails when the main node is gone.

A main thread that holds Python's lock for all of `cluster.timeout` (one long call into a C
library that keeps it) also stops the signs of life: raise `cluster.timeout` for such a download.
"""

import contextlib
import json
import os
import socket
import sys
import time
from dataclasses import asdict
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import DistError

from trainkit.run import own_failures, stopping
from trainkit.run.exit_codes import LOST_NODE
from trainkit.run.job_store import job_store, keys_of_this_attempt, wait_until
from trainkit.run.placement import Placement, nodes_of
from trainkit.run.store_threads import StoreThread

BEAT_SECONDS = 1.0  # how often each process says it is alive, and looks at the others
READ_SECONDS = 5.0  # how long the main node's first process waits for the others to read its line
ROLL_CALL_SECONDS = 3 * BEAT_SECONDS  # after a failure, a process that gives no sign of life for this long is lost
BARRIER_AFTER_PREPARING = "pre_setup"  # the name of Lightning's first barrier after prepare_data


class PreparationWatch(StoreThread):
    """Signs of life in the job's store while the job prepares data; names the processes that fell silent."""

    def __init__(self, prefix: str, here: Placement, world_size: int, timeout: timedelta) -> None:
        super().__init__(name="trainkit-preparation-watch")
        self.prefix, self.here, self.world_size = prefix, here, world_size
        self.timeout = timeout

    def run(self) -> None:
        store = job_store()
        # The others' counts as last read, and when each last changed; a count never read is None.
        counts: dict[int, int | None] = dict.fromkeys(range(self.world_size))
        changed = dict.fromkeys(range(self.world_size), time.monotonic())
        rank = self.here.global_rank
        watched = [other for other in range(self.world_size) if other != rank] if rank == 0 else [0]
        try:
            store.set(self._key("where", rank), json.dumps(asdict(self.here)))
            while not self.stopping.wait(BEAT_SECONDS):
                store.add(self._key("beats", rank), 1)
                failure = own_failures.recorded_by_another()
                if failure is not None:  # a peer failed with an error of its own (in prepare_data): not a loss
                    own_failures.end_with(failure)
                if rank != 0 and store.check([self._key("silent")]):
                    self._end(store, store.get(self._key("silent")).decode())
                now = time.monotonic()
                for other in watched:
                    count = store.add(self._key("beats", other), 0)
                    if count != counts[other]:
                        counts[other], changed[other] = count, now
                silent = [other for other in watched if now - changed[other] > self.timeout.total_seconds()]
                if silent:
                    self._end(store, self._describe(store, silent), readers=self.world_size - 1 - len(silent))
        except DistError:  # the store lives in the main node's first process: that process is gone or frozen
            self._end(None, "the main node (node 0) no longer answers: it died or was stopped")

    def end_after(self, failure: BaseException) -> None:
        """After `failure` (a peer's connection closed): in the main node's first process, name the processes that
        give no sign of life and end every process with that line, as after a stall. Others wait for that line."""
        if self.here.global_rank != 0:
            self.join(ROLL_CALL_SECONDS + READ_SECONDS + 2 * BEAT_SECONDS)  # this watch reads the line and ends us
            return
        try:
            store = job_store()
            keys = [self._key("beats", rank) for rank in range(self.world_size)]
            before = [store.add(key, 0) for key in keys]
            time.sleep(ROLL_CALL_SECONDS)
            silent = [rank for rank, key in enumerate(keys) if store.add(key, 0) == before[rank]]
            if not silent:
                return
            named = self._named(store, silent)
        except DistError:
            return
        why = f"{named} stopped answering ({type(failure).__name__}): it probably died or was stopped"
        self._end(store, why, readers=self.world_size - 1 - len(silent))

    def _named(self, store: dist.Store, ranks: list[int]) -> str:
        """The nodes of these processes, with their hosts as each process wrote them when the watch began."""
        where = [self._key("where", rank) for rank in range(self.world_size)]
        placement = [Placement(**json.loads(store.get(key))) for key in where if store.check([key])]
        return nodes_of(ranks, placement) or f"global ranks {', '.join(map(str, ranks))}"

    def _describe(self, store: dist.Store, silent: list[int]) -> str:
        named = self._named(store, silent)
        return f"{named} gave no sign of life for {self.timeout} (cluster.timeout): it probably stalled or was stopped"

    def _end(self, store: dist.Store | None, why: str, readers: int = 0) -> None:
        """Say why in one line, and exit 75; the main node's first process publishes the line for the others first,
        and waits until they have said it (the processes it started end with it, and the store with it)."""
        stopping.end_on_own_terms()  # torchrun stops a node's other processes as soon as one ended: say it first
        main = self.here.global_rank == 0
        if store is not None and main:
            with contextlib.suppress(DistError):
                store.set(self._key("silent"), why)
                wait_until(lambda: store.add(self._key("read"), 0) >= readers, READ_SECONDS)
        sys.stdout.flush()
        print(
            f"error: node {self.here.node_rank} (global rank {self.here.global_rank}) lost contact with the other"
            f" processes of the job while it prepared data: {why}: see its log.",
            file=sys.stderr,
            flush=True,
        )
        if store is not None and not main:
            with contextlib.suppress(DistError):
                store.add(self._key("read"), 1)
        os._exit(LOST_NODE)  # the main thread waits in C code, in Lightning's barrier

    def _key(self, *parts: object) -> str:
        return "/".join(map(str, (self.prefix, *parts)))


_watch: PreparationWatch | None = None
_watches_started = 0  # a process may prepare data more than once (fit, then test): each time has keys of its own


def watch_preparation(node_rank: int, global_rank: int, world_size: int, timeout: timedelta) -> None:
    """Start this process's PreparationWatch, once the job has formed and before it prepares data."""
    global _watch, _watches_started
    if not (dist.is_available() and dist.is_initialized()) or world_size < 2:
        return
    stop_watching_preparation()
    _watches_started += 1
    prefix = f"{keys_of_this_attempt('preparing')}/{_watches_started}"
    _watch = PreparationWatch(prefix, Placement(node_rank, global_rank, socket.gethostname()), world_size, timeout)
    _watch.start()


def end_after_a_failure(failure: BaseException) -> None:
    """While the job prepares data, a failure to reach a peer (a node that died there) ends every process with 75 and
    a line naming the processes that gave no sign of life since. Returns at other times, or when none fell silent."""
    if _watch is not None and _watch.is_alive():
        _watch.end_after(failure)


def stop_watching_preparation() -> None:
    """The job's data are prepared: Lightning's barriers have timeouts again."""
    if _watch is not None:
        _watch.stop_and_wait()


def at_barrier(name: str | None) -> None:
    """For a strategy's `barrier`: Lightning's first barrier after `prepare_data` (before the setup hooks) has a
    timeout again, and ends the watch."""
    if name == BARRIER_AFTER_PREPARING:
        stop_watching_preparation()
