"""Lightning's DDP, with the job's start bounded on its own and its processes watched while it prepares data.

Every process checks in before the process group forms, for as long as `cluster.join_timeout`
(cluster/arrival.py), so that `cluster.timeout` bounds only collectives. Lightning waits around
`prepare_data` without a timeout; until the first barrier after it, each process sends signs of
life instead, so that a node that froze there ends the job with 75 and a line naming it
(run/preparing.py). The command line registers this class as the "ddp" strategy, which "auto"
picks for several processes.
"""

from datetime import timedelta
from typing import Any

from lightning.pytorch.strategies import DDPStrategy

from trainkit.cluster.arrival import wait_for_the_job
from trainkit.cluster.settings import ClusterSettings
from trainkit.run.own_failures import job_formed
from trainkit.run.preparing import at_barrier, watch_preparation


class WatchedDDPStrategy(DDPStrategy):
    """DDPStrategy (same arguments, and `join_timeout`: how long the processes wait for each other to form the job),
    whose processes send signs of life until the job's data are prepared."""

    def __init__(self, *args: Any, join_timeout: timedelta = ClusterSettings.join_timeout, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.join_timeout = join_timeout

    def setup_distributed(self) -> None:
        self._arrival_store = wait_for_the_job(self, self.join_timeout)
        super().setup_distributed()

    def setup_environment(self) -> None:
        super().setup_environment()
        job_formed(self.node_rank, self.global_rank, self.world_size)
        watch_preparation(self.node_rank, self.global_rank, self.world_size, self._timeout)

    def barrier(self, name: str | None = None) -> None:
        at_barrier(name)
        super().barrier(name)
