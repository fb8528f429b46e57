"""Every process of the job checks in before the process group forms, for as long as `cluster.join_timeout`.

Nodes, and the processes Lightning starts on them, come up at different times: an image pull, a busy
scheduler, slow imports on a loaded machine. torch waits for them in `init_process_group` with the
timeout its collectives keep afterwards, so a short `cluster.timeout` (a lost node found fast) would
also be all the time a job has to start. Here each process first checks in at the main node's
key-value store (the one the process group uses next) and waits for the others; once all are there,
the group forms at once, and `cluster.timeout` bounds only what follows.
"""

import os
import socket
import time
from datetime import timedelta

import torch.distributed as dist
from lightning.pytorch.strategies import ParallelStrategy
from torch.distributed import DistError, TCPStore

from trainkit.cluster.roll_call import MainPortTaken, NodesDidNotArrive, join_main_store
from trainkit.cluster.waiting import Reminder, log

POLL_SECONDS = 0.2


def wait_for_every_process(
    address: str, port: int, global_rank: int, world_size: int, processes_per_node: int, timeout: timedelta
) -> TCPStore:
    """Check in and wait until all `world_size` processes have; the store, to keep open until the group forms
    (on global rank 0 it serves the store the group then reuses)."""
    # Who serves the store, as torch's process group decides it: torchrun's agent when this is its own
    # address, otherwise global rank 0.
    agents_address = (os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")) == (address, str(port))
    agent_serves = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and agents_address
    serves = global_rank == 0 and not agent_serves
    if serves:
        try:
            store = TCPStore(address, port, is_master=True, multi_tenant=True, timeout=timeout, wait_for_workers=False)
        except DistError:
            raise MainPortTaken(port) from None
    else:
        store = join_main_store(address, port, timeout)
    # torchrun's agent keeps its store across restarts of the workers: each attempt checks in anew.
    prefix = f"trainkit/arrived/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    deadline = time.monotonic() + timeout.total_seconds()
    try:
        store.set(f"{prefix}{global_rank}", socket.gethostname())
        store.add(f"{prefix}count", 1)
        reminder = Reminder()
        while store.add(f"{prefix}count", 0) < world_size:
            if reminder.due():
                log.info(f"waiting for global rank {', '.join(map(str, _missing(store, prefix, world_size)))} to"
                         f" join at {address}:{port}; giving up after {timeout} (cluster.join_timeout)")  # fmt: skip
            if time.monotonic() > deadline:
                absent = _missing(store, prefix, world_size)
                nodes = sorted({rank // processes_per_node for rank in absent})
                raise NodesDidNotArrive(
                    f"only {world_size - len(absent)} of {world_size} processes joined at {address}:{port} within"
                    f" {timeout} (cluster.join_timeout): global rank {', '.join(map(str, absent))} of node"
                    f" {', '.join(map(str, nodes))} did not arrive. Check that every node was started and can reach"
                    " that address."
                )
            time.sleep(POLL_SECONDS)
    except DistError:
        raise NodesDidNotArrive(
            f"the main node at {address}:{port} stopped answering while the job formed: node 0 ended (see its log)"
        ) from None
    return store


def _missing(store: TCPStore, prefix: str, world_size: int) -> list[int]:
    """The global ranks that have not checked in."""
    return [rank for rank in range(world_size) if not store.check([f"{prefix}{rank}"])]


def wait_for_the_job(strategy: ParallelStrategy, timeout: timedelta) -> TCPStore | None:
    """`wait_for_every_process` for a strategy about to form its process group; None when there is nothing
    to wait for: one process, or a group formed already (an earlier fit in this process). Keep the store
    while the strategy lives: on global rank 0 it serves the store the group reuses."""
    strategy.set_world_ranks()  # as the strategy's own set-up does next; it needs them here first
    if strategy.world_size == 1 or dist.is_initialized():
        return None
    environment = strategy.cluster_environment
    return wait_for_every_process(environment.main_address, environment.main_port, strategy.global_rank,
                                  strategy.world_size, strategy.num_processes, timeout)  # fmt: skip
