"""wandb's service process (wandb-core), which can end before the training process does."""

import contextlib


def leave_wandb() -> None:
    """End wandb in this process now, and say nothing if its service has already ended.

    The service can end alone: killed for memory, or stopped by the SIGTERM that Slurm sends to every
    process of a job. wandb's own exit hook would then print a traceback when it cannot reach it;
    after this call that hook has nothing left to do. A service that still runs finishes the run, as
    the hook would have.
    """
    import wandb

    # SystemExit: wandb exits when its service ended with an error status, which says nothing more.
    with contextlib.suppress(ConnectionError, SystemExit):
        wandb.teardown()
