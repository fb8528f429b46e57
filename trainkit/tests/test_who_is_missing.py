"""After a lost peer, the survivors ask who is missing: a survivor blocked in a collective is not named as lost.

Real processes in one gloo group. In the first test, process 3 is lost (it never answers), process 1
notices the loss only after the others stopped waiting for answers, as a process blocked in a gloo
collective that the loss does not end (it waits for the timeout). In the second, one survivor waits in
the stop agreement on a stuck peer and stops waiting once another reported the loss, and one is
blocked in a plain all-reduce, where only its LossWatch thread can answer for it. Every survivor
must name the lost process alone. In the third, every process answers, but one's main thread hangs
outside any collective: it alone is named as stuck (not the one that waits in an all-reduce and has not
noticed yet), and it ends itself with 75.
"""

import contextlib
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainkit.checkpoints.agreement import Agreement
from trainkit.run import lost_peers
from trainkit.run.lost_peers import LossReported

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
        time.sleep(lost_peers.QUIET_SECONDS + 1)  # past the quiet time after the last answer
    (out / f"missing-{rank}.json").write_text(json.dumps(lost_peers.ask_who_is_missing(rank, WORLD).lost))


def test_a_survivor_that_answers_late_is_not_named_as_lost(tmp_path):
    mp.spawn(survivor, args=(free_port(), tmp_path), nprocs=WORLD, join=True)
    survivors = [rank for rank in range(WORLD) if rank != LOST]
    answers = {rank: json.loads((tmp_path / f"missing-{rank}.json").read_text()) for rank in survivors}
    assert answers == {rank: [LOST] for rank in survivors}


STUCK = 3  # stalled: its connections stay open, it never takes part in a collective nor answers
STUCK_SECONDS = 12.0
IN_AGREEMENT, IN_COLLECTIVE = 1, 2


def blocked(rank: int, port: int, out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    timeout = timedelta(seconds=60)
    dist.init_process_group("gloo", rank=rank, world_size=4, timeout=timeout)
    if rank == STUCK:  # no thread of it runs, as under SIGSTOP
        time.sleep(STUCK_SECONDS)
        return
    lost_peers.watch_for_losses(rank, 4)
    report = {}
    if rank == 0:  # as if an error of its own had told it of the loss
        time.sleep(1.0)
    elif rank == IN_AGREEMENT:
        agreement = Agreement()
        agreement.start(timeout)
        agreement.propose(1)
        began = time.monotonic()
        try:
            agreement.agreed()
        except LossReported:
            report["stopped waiting after"] = time.monotonic() - began
    else:  # blocked where nothing can look for a report, as in DDP's all-reduce of the gradients
        with contextlib.suppress(RuntimeError):  # gloo's, once the others end
            dist.all_reduce(torch.zeros(1))
    report["missing"] = lost_peers.ask_who_is_missing(rank, 4).lost
    (out / f"rank-{rank}.json").write_text(json.dumps(report))
    # What is tested is the report. Python's exit would tear down the gloo group of a collective that failed,
    # which on a loaded machine sometimes aborts in gloo ("terminate called without an active exception").
    os._exit(0)


def test_survivors_blocked_in_a_collective_answer_and_stop_waiting_for_the_agreement(tmp_path):
    mp.spawn(blocked, args=(free_port(), tmp_path), nprocs=4, join=True)
    reports = {rank: json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in (0, 1, 2)}
    assert {rank: report["missing"] for rank, report in reports.items()} == {0: [STUCK], 1: [STUCK], 2: [STUCK]}
    # about a second after the report, not the timeout nor the stuck process's end
    assert reports[IN_AGREEMENT]["stopped waiting after"] < STUCK_SECONDS / 2, reports


HUNG, WAITING = 2, 1


def hung_or_waiting(rank: int, port: int, out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=3, timeout=timedelta(seconds=60))
    lost_peers.watch_for_losses(rank, 3)
    if rank == HUNG:  # its LossWatch answers, and ends it once it is named
        time.sleep(120)
    if rank == WAITING:  # not noticing the loss within STUCK_SECONDS: until the hung process ends
        with contextlib.suppress(RuntimeError):
            dist.all_reduce(torch.zeros(1))
    found = lost_peers.ask_who_is_missing(rank, 3)  # rank 0: as if an error of its own had told it of the loss
    (out / f"rank-{rank}.json").write_text(json.dumps({"lost": found.lost, "stuck": found.stuck}))
    os._exit(0)


def test_a_process_whose_main_thread_hangs_is_named_as_stuck_and_ends_with_75(tmp_path):
    context = mp.start_processes(hung_or_waiting, args=(free_port(), tmp_path), nprocs=3, join=False)
    for process in context.processes:
        process.join(timeout=60)
    assert [process.exitcode for process in context.processes] == [0, 0, 75]
    for rank in (0, WAITING):
        found = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert found["lost"] == [] and list(found["stuck"]) == [str(HUNG)], found
        assert found["stuck"][str(HUNG)].endswith(" in hung_or_waiting"), found
