"""wandb's Launch module, imported before torch by the process that may start the wandb run: a faster start.

`wandb.init` always imports `wandb.sdk.launch.inputs`, whose pydantic models read their fields'
docstrings from the source. On Python 3.11 and 3.12, pydantic finds the source by walking frames
with `inspect.getmodule`, which scans every loaded module for each new file it meets: 0.8-1.4 s once
torch and Lightning are loaded (3,300 modules), 0.25 s before them (800). Python 3.13 finds the
source without that scan.

Only the process that Lightning takes for rank 0 when it is imported does the import. That is
also the first process of every other node, where the import costs its 0.25 s for nothing; and a
run with another logger pays it once.
"""

import importlib.util
import sys

from trainkit.cluster.launch_variables import rank_at_import


def preload_wandb_launch() -> None:
    """Import wandb's Launch inputs now, before torch, if this process may be the one that starts the run."""
    if sys.version_info >= (3, 13) or rank_at_import() != 0 or importlib.util.find_spec("wandb") is None:
        return
    try:
        import wandb.sdk.launch.inputs.internal  # noqa: F401
    except ImportError:  # a broken wandb is reported where the logger starts it
        return
