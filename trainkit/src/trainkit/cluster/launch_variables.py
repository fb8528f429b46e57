"""Read the variables a launcher or platform sets, refusing a bad value with one line that names it.

Nothing here imports Lightning: Lightning reads RANK and LOCAL_RANK as integers when it is
imported, so train.py checks them with `exit_on_bad_rank_variables` first.
"""

import os
import sys

from trainkit.run.errors import ConfigError
from trainkit.run.exit_codes import CONFIG_ERROR

# What Lightning reads at import to know whether this process is rank 0.
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")


class ClusterConfigError(ConfigError):
    """A platform variable is missing or wrong. Raised before any process group is formed."""


def require(name: str) -> str:
    value = os.environ.get(name)
    if value is None:
        raise ClusterConfigError(f"{name} is not set")
    if not value.strip():
        raise ClusterConfigError(f"{name} is set but empty")
    return value.strip()


def require_int(name: str) -> int:
    value = require(name)
    try:
        return int(value)
    except ValueError:
        raise ClusterConfigError(f"{name}={value!r} is not an integer") from None


def require_port(name: str) -> int:
    port = require_int(name)
    if not 1 <= port <= 65535:
        raise ClusterConfigError(f"{name}={port} is not a port number (1-65535)")
    return port


def require_rank_and_size(rank_name: str, size_name: str) -> tuple[int, int]:
    rank, size = require_int(rank_name), require_int(size_name)
    if size < 1:
        raise ClusterConfigError(f"{size_name}={size} must be at least 1")
    if not 0 <= rank < size:
        raise ClusterConfigError(f"{rank_name}={rank} is outside 0..{size - 1} ({size_name}={size})")
    return rank, size


def rank_at_import() -> int:
    """The rank Lightning takes this process for when it is imported: the first rank variable set, else 0.

    Checked by `exit_on_bad_rank_variables` first. The cluster environment gives the true rank later.
    """
    for name in RANK_VARIABLES:
        if name in os.environ:
            return int(os.environ[name])
    return 0


def exit_on_bad_rank_variables() -> None:
    """End the process with one line (status 2) if a rank variable is set but is not a rank."""
    try:
        for name in RANK_VARIABLES:
            if name in os.environ and require_int(name) < 0:
                raise ClusterConfigError(f"{name}={os.environ[name]} is negative")
    except ClusterConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(CONFIG_ERROR)
