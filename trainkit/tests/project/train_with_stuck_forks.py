"""train.py, except that every process forked from it (a data loader worker) is stuck before it starts.

As on a lock another thread held at the fork. The hook is registered before the kit's, so it runs
first in the child, and the kit's bound on a worker's start is 5 s instead of a minute.
"""

import os
import runpy
import time
from pathlib import Path

if os.environ.get("TRAINKIT_SUPERVISED"):  # in the training process, not its parent (run/supervisor.py)
    os.register_at_fork(after_in_child=lambda: time.sleep(3600))

import trainkit.run.worker_start

trainkit.run.worker_start.WORKER_START_SECONDS = 5.0
runpy.run_path(str(Path(__file__).with_name("train.py")), run_name="__main__")
