"""What each process tells the log: where it sits in the job, and why a distributed job failed."""

import logging
import re
import socket
import subprocess
from datetime import timedelta

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.distributed import DistError

from trainkit.run import own_failures, preparing, stopping
from trainkit.run.lost_peers import (
    ROLL_CALL_SECONDS,
    STUCK_SECONDS,
    WhoIsMissing,
    ask_who_is_missing,
    stop_watching,
    training_begins,
    training_ends,
    watch_for_losses,
)
from trainkit.run.node_watch import failed_on_its_own, say_it_failed
from trainkit.run.placement import Placement, nodes_of

log = logging.getLogger(__name__)


class LogProcessPlacement(Callback):
    """Each process logs one line once the job has formed, to make launch logs easy to check."""

    def __init__(self, platform: str) -> None:
        self.platform = platform

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        environment = getattr(trainer.strategy, "cluster_environment", None)
        main = f"{environment.main_address}:{environment.main_port}" if environment else "none"
        log.info(
            f"[{self.platform}] node_rank={trainer.node_rank} local_rank={trainer.local_rank} "
            f"global_rank={trainer.global_rank} world_size={trainer.world_size} main={main}"
        )


class ExplainDistributedFailure(Callback):
    """When the job fails because a process is missing or lost, end the traceback with which node it was.

    Where every process runs (node, host name) is shared once the job has formed: after a node is
    lost its name may no longer resolve. Which processes were lost is asked (run/lost_peers.py).
    """

    def __init__(self, timeout: timedelta) -> None:
        self.timeout = timeout
        self.placement: list[Placement] = []

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            return
        here = Placement(trainer.node_rank, trainer.global_rank, socket.gethostname())
        self.placement = [here] * trainer.world_size
        dist.all_gather_object(self.placement, here)
        watch_for_losses(trainer.global_rank, trainer.world_size)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        training_begins()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        training_ends()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        stop_watching()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        stopping.let_an_exit_under_way_finish()  # a stop signal's, before Lightning's teardown kills the others
        if not lost_contact(exception):
            return
        failure = own_failures.recorded_by_another()
        if failure is not None:  # the contact lost was with a process that failed with an error of its own
            own_failures.end_with(failure)
        stopping.end_on_own_terms()  # a SIGTERM now (torchrun's, once another process ended) waits for the line
        # Lightning's watcher SIGKILLs this process as soon as one it started exits non-zero, which
        # they are about to do: take them off its list, and wait for them below instead.
        watched = getattr(trainer.strategy.launcher, "procs", [])
        started = list(watched)
        watched.clear()
        preparing.end_after_a_failure(exception)  # lost in prepare_data, before the placement below is known
        missing = None
        if self.placement and dist.is_initialized():
            missing = ask_who_is_missing(trainer.global_rank, trainer.world_size)
        for process in started:
            try:
                process.wait(timeout=ROLL_CALL_SECONDS)
            except subprocess.TimeoutExpired:
                process.kill()
        failed = failed_on_its_own(started)
        if failed is not None:  # the contact lost was with a process of this node, ended by an error of its own
            exception.add_note(say_it_failed(failed, started))
            exception.trainkit_status = failed.returncode  # read by status_after
            return
        exception.add_note(explain(exception, trainer, self.timeout, self.placement, missing))


# What gloo's and NCCL's errors say when a peer died or stopped answering. A stalled peer (its
# connections open) ends in "Application timeout caused pair closure", which names neither backend.
LOST_CONTACT_WORDS = ("gloo", "nccl", "pair closure")


def lost_contact(exception: BaseException) -> bool:
    """Whether the job failed because processes could not reach each other (exit_codes.LOST_NODE)."""
    message = str(exception).lower()
    return isinstance(exception, DistError) or any(words in message for words in LOST_CONTACT_WORDS)


def explain(
    exception: BaseException,
    trainer: Trainer,
    timeout: timedelta,
    placement: list[Placement],
    missing: WhoIsMissing | None = None,
) -> str:
    """One line for the end of the log: which processes or nodes are missing, and where they were awaited."""
    environment = getattr(trainer.strategy, "cluster_environment", None)
    main = f"{environment.main_address}:{environment.main_port}" if environment else "the main node"
    per_node = trainer.num_devices
    joined = re.search(r"(\d+)/(\d+) clients joined", str(exception))
    if joined:
        arrived, expected = int(joined.group(1)), int(joined.group(2))
        missing_nodes = -(-(expected - arrived) // per_node)
        return (
            f"error: only {arrived} of {expected} processes joined at {main} within {timeout}:"
            f" {missing_nodes} of {expected // per_node} nodes did not arrive ({per_node} processes each)."
            " Check that every node was started and can reach that address."
        )
    if not placement and trainer.global_rank != 0 and "connect" in str(exception).lower():
        return f"error: could not reach the main node at {main} within {timeout}; is node 0 running?"
    here = (
        f"error: node {trainer.node_rank} (global rank {trainer.global_rank}) lost contact with the other processes"
        f" of the job ({type(exception).__name__});"
    )
    if missing is None and placement:
        # The roll call lives in node 0's first process. A process that waited out cluster.timeout in a
        # collective the loss did not end (gloo's) finds it gone once the others have answered and ended.
        return (
            f"{here} the main node ({main}) no longer answers: node 0 died or was stopped, or its processes had"
            " already ended after losing another one: see the other nodes' logs."
        )
    if missing is not None and missing.stuck:
        return f"{here} {stuck_processes(missing.stuck, placement)}"
    if missing is not None and not missing.lost:  # every process is alive and noticed: one was stuck for a while
        stuck = "every process still answers, so one is stuck (a peer stopped answering)"
        return f"{here} {stuck}: see whose log ends first."
    lost = "another node" if missing is None else nodes_of(missing.lost, placement)
    return f"{here} {lost} probably died or was stopped: see its log."


def stuck_processes(stuck: dict[int, str], placement: list[Placement]) -> str:
    """E.g. `stuck: global rank 3 (node 1, host test-1) at /src/model.py:42 in training_step; ...`."""
    each = [
        f"global rank {rank} (node {placement[rank].node_rank}, host {placement[rank].host}) at {where}"
        for rank, where in stuck.items()
    ]
    return (
        f"stuck: {' and '.join(each)}. It still answers, but its main thread never reached the collective the"
        f" others waited in, nor noticed their failure within {STUCK_SECONDS:.0f} s (a hung device call, file"
        " read or lock): its log has the main thread's whole stack."
    )
