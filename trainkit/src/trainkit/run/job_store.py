"""The store the job formed with (it lives in global rank 0): its keys for this attempt, and waiting on it."""

import os
import time
from collections.abc import Callable

import torch.distributed as dist


def job_store() -> dist.Store:
    """The store the job formed with, over connections already open: after a node is lost, a new
    connection may find the main node's name unresolvable for a while."""
    return dist.distributed_c10d._get_default_store()  # torch has no public getter


def keys_of_this_attempt(name: str) -> str:
    """Where `name`'s keys go in the job's store: torchrun's store outlives its restarts, the attempt does not."""
    return f"{name}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def wait_until(condition: Callable[[], bool], seconds: float) -> bool:
    """Whether `condition()` became true within `seconds`, asked every 0.2 s."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True
