"""Lightning's DDP, with the processes watched while the job prepares its data.

Lightning waits around `prepare_data` without a timeout; until the first barrier after it, each
process sends signs of life instead, so that a node that froze there ends the job with 75 and a
line naming it (run/preparing.py). The command line registers this class as the "ddp" strategy,
which "auto" picks for several processes.
"""

from lightning.pytorch.strategies import DDPStrategy

from trainkit.run.preparing import at_barrier, watch_preparation


class WatchedDDPStrategy(DDPStrategy):
    """DDPStrategy (same arguments), whose processes send signs of life until the job's data are prepared."""

    def setup_environment(self) -> None:
        super().setup_environment()
        watch_preparation(self.node_rank, self.global_rank, self.world_size, self._timeout)

    def barrier(self, name: str | None = None) -> None:
        at_barrier(name)
        super().barrier(name)
