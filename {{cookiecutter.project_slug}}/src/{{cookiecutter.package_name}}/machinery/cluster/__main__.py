"""Print which launch this process belongs to, without training.

Run on a node of the launch to debug it: `python -m {{ cookiecutter.package_name }}.machinery.cluster`.
"""

import sys

from ..exit_codes import CONFIG_ERROR
from .launch_variables import ClusterConfigError
from .platforms import describe, detect_platform


def main() -> None:
    try:
        print(describe(detect_platform()))
    except ClusterConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(CONFIG_ERROR)


if __name__ == "__main__":
    main()
