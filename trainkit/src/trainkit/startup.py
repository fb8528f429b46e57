"""What train.py imports first: stop signals handled from the first moment, then the command line.

Importing this module does the work, in this order, because each step must come before the next
import: SIGTERM and SIGINT stop the job from here on, during the imports below too, and also as
PID 1 in a container, where the kernel drops signals a process has no handler for (run/stopping.py);
the launch's rank variables are checked before Lightning reads them at import (a bad one would
end in its traceback); and the garbage collector is frozen once torch and Lightning are loaded:
they create several hundred thousand objects that live as long as the process, which it would
otherwise scan over and over (most of a second), and forked data loader workers share their memory.
"""

from trainkit.run.stopping import handle_stop_signals

handle_stop_signals()

import gc  # noqa: E402

gc.disable()
from trainkit.cluster.launch_variables import exit_on_bad_rank_variables  # noqa: E402

exit_on_bad_rank_variables()
from trainkit.cli import main  # noqa: E402

gc.freeze()
gc.enable()

__all__ = ["main"]
