"""`python -m trainkit.sweep ...`: the local sweep, once optuna (the `[sweep]` extra) is there."""

import sys

from trainkit.run.exit_codes import CONFIG_ERROR
from trainkit.run.extras import MissingExtra, require


def main() -> int:
    try:
        require("optuna", "the local sweep")
    except MissingExtra as error:
        print(f"error: {error}", file=sys.stderr)
        return CONFIG_ERROR
    from trainkit.sweep.local import main as run_sweep

    return run_sweep()


if __name__ == "__main__":
    sys.exit(main())
