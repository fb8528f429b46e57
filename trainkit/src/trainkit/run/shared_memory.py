"""/dev/shm, checked at start: one warning line on a node that needs more than it has.

NCCL passes data between the GPUs of a node through /dev/shm, and DataLoader workers hand their
batches to the training process through it. A container gets 64 MB unless its platform says
otherwise (`docker run --shm-size`, a memory emptyDir on Kubernetes, a tmpfs on Swarm), and running
out shows up mid-run as a bus error in a worker or an NCCL error, far from its cause.
"""

import os
from pathlib import Path

SHARED_MEMORY = Path("/dev/shm")
ENOUGH_BYTES = 1 << 30  # 1 GiB
MIB = 1 << 20


def size_of(path: Path) -> int | None:
    """The size of the file system at `path` in bytes, or None where there is none (macOS has no /dev/shm)."""
    try:
        stats = os.statvfs(path)
    except OSError:
        return None
    return stats.f_frsize * stats.f_blocks


def shared_memory_warning(size: int | None, gpus_on_node: int, loader_workers: int) -> str | None:
    """What to set where /dev/shm has `size` bytes, under 1 GiB, and this node's GPUs (NCCL) or each process's
    loader workers use it; None where it has enough, or nothing uses it, or there is none."""
    users = []
    if gpus_on_node > 1:
        users.append(f"NCCL between this node's {gpus_on_node} GPUs")
    if loader_workers > 0:
        users.append(f"{loader_workers} data loader worker{'s' if loader_workers > 1 else ''} per process")
    if not users or size is None or size >= ENOUGH_BYTES:
        return None
    return (
        f"{SHARED_MEMORY} has only {size // MIB} MiB, too little for {' and '.join(users)}: give the container"
        " 16 GB or more (docker run --shm-size=16g; launch/<platform>/README.md says how)"
    )
