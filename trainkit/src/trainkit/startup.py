"""What train.py imports first: stop signals handled from the first moment, then the command line.

Importing this module does the work, in this order, because each step must come before the next
import: the process a platform started runs the same command again as a child and only waits for
it, so that an abort by NCCL's watchdog ends the node with a retry (run/supervisor.py); SIGTERM and
SIGINT stop the job from here on, during the imports below too, and also as PID 1 in a container,
where the kernel drops signals a process has no handler for (run/stopping.py); a data loader
worker stuck in its fork ends the job instead of hanging it (run/worker_start.py); NCCL's watchdog and
flight recorder are set up before torch loads (run/nccl.py); the launch's rank variables are
checked before Lightning reads them at import (a bad one would end in its traceback); wandb's
Launch module is imported before torch, where it costs a quarter of the time (tracking/wandb_preload.py);
and the garbage collector is frozen once torch and Lightning are loaded: they create several hundred
thousand objects that live as long as the process, which it would otherwise scan over and over
(most of a second), and forked data loader workers share their memory.
"""

from trainkit.run.supervisor import supervise

supervise()
from trainkit.run.stopping import handle_stop_signals  # noqa: E402

handle_stop_signals()
from trainkit.run.worker_start import watch_worker_starts  # noqa: E402

watch_worker_starts()
from trainkit.run.nccl import set_nccl_defaults  # noqa: E402

set_nccl_defaults()

import gc  # noqa: E402

gc.disable()
from trainkit.cluster.launch_variables import exit_on_bad_rank_variables  # noqa: E402

exit_on_bad_rank_variables()
from trainkit.tracking.wandb_preload import preload_wandb_launch  # noqa: E402

preload_wandb_launch()
from trainkit.cli import main  # noqa: E402

gc.freeze()
gc.enable()

__all__ = ["main"]
