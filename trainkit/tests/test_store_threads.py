"""A process whose kit threads poll the job's store exits with its own status, not an abort.

Each watch polls the store with no pause here (its interval set to 0), so that Python's exit almost
always finds it inside a store call: left running, that aborts the process (SIGABRT, "terminate called
without an active exception"), which the supervisor would turn into 75 after a clean 143.
"""

import subprocess
import sys

import pytest

from .helpers import free_port

EXITS_WITH_A_BUSY_WATCH = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
from trainkit.run import lost_peers, preparing
from trainkit.run.placement import Placement

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
if "{watch}" == "loss":
    lost_peers.CHECK_SECONDS = 0.0
    lost_peers.watch_for_losses(0, 1)
else:
    preparing.BEAT_SECONDS = 0.0
    preparing.PreparationWatch("preparing/0/1", Placement(0, 0, "here"), 1, timedelta(seconds=60)).start()
time.sleep(0.3)
sys.exit(143)  # as after a checkpoint on SIGTERM, with the watch left running
"""


@pytest.mark.parametrize("watch", ["loss", "preparation"])
def test_a_watch_busy_in_the_store_does_not_abort_the_exit(watch):
    for _ in range(3):  # left running, the watch aborted all 3 exits
        script = EXITS_WITH_A_BUSY_WATCH.format(port=free_port(), watch=watch)
        ended = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
        assert ended.returncode == 143, ended.stderr[-2000:]
