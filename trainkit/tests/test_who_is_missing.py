"""After a lost peer, the survivors ask who is missing: a survivor that notices late is not named as lost.

Four real processes in one gloo group; process 3 is lost (it never answers), process 1 notices the
loss only after the others stopped waiting for answers, as a process blocked in a gloo collective
that the loss does not end (it waits for the timeout). Every survivor must name process 3 alone.
"""

import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from trainkit.run import diagnostics

from .helpers import free_port

WORLD = 4
LOST = 3
LATE = 1


def survivor(rank: int, port: int, out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    if rank == LOST:
        return  # gone without a word (the test's process group outlives it: nothing is torn down)
    if rank == LATE:
        time.sleep(diagnostics.QUIET_SECONDS + 1)  # past the quiet time after the last answer
    (out / f"missing-{rank}.json").write_text(json.dumps(diagnostics.ask_who_is_missing(rank, WORLD)))


def test_a_survivor_that_answers_late_is_not_named_as_lost(tmp_path):
    mp.spawn(survivor, args=(free_port(), tmp_path), nprocs=WORLD, join=True)
    survivors = [rank for rank in range(WORLD) if rank != LOST]
    answers = {rank: json.loads((tmp_path / f"missing-{rank}.json").read_text()) for rank in survivors}
    assert answers == {rank: [LOST] for rank in survivors}
