"""Print which launch this process belongs to, without training.

Run on a node of the launch to debug it: `python -m trainkit.cluster`.
"""

import sys

from trainkit.cluster.launch_variables import ClusterConfigError
from trainkit.cluster.platforms import describe, detect_platform
from trainkit.run.exit_codes import CONFIG_ERROR


def main() -> None:
    try:
        print(describe(detect_platform()))
    except ClusterConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(CONFIG_ERROR)


if __name__ == "__main__":
    main()
