"""The `cluster:` section of the config: how the processes of a job find each other."""

from dataclasses import dataclass, field
from datetime import timedelta

DEFAULT_MAIN_PORT = 29500  # torch.distributed's own default; projects set theirs in configs/experiment.yaml


@dataclass
class ClusterSettings:
    """The `cluster:` section of the config: how the processes of a job find each other.

    Args:
        main_port: port of the main node when the platform sets no MASTER_PORT; the same on every node. On one
            machine with no platform, Lightning takes a free port (the run's first line shows it).
        address_timeout: seconds to wait for the main node's host name to resolve (pods start at
            different times and a headless service's DNS lags behind).
        join_timeout: how long the processes wait for each other to form the job: nodes start at
            different times (an image pull, a busy scheduler). Then it ends with 75, naming who is missing.
        timeout: how long a process waits for the others in a collective once the job has formed,
            before the job fails instead of hanging (torch's own default is 30 minutes).
        environments: class paths of ClusterEnvironments of your own, for a platform trainkit does not
            know; the first whose `detect()` is true runs the job, before the platforms trainkit knows.
    """

    main_port: int = DEFAULT_MAIN_PORT
    address_timeout: float = 300.0
    join_timeout: timedelta = timedelta(minutes=10)
    timeout: timedelta = timedelta(minutes=5)
    environments: list[str] = field(default_factory=list)
