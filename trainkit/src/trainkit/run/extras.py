"""Optional features, each with the extra that installs it: a missing one is one line (exit 2), not a traceback.

A default install holds what a laptop run and a cluster run need. Checkpoints in S3 need boto3 (`[s3]`), the
local sweep optuna (`[sweep]`), streamed data litdata (`[streaming]`).
"""

import importlib
import re
from types import ModuleType

from trainkit.run.errors import ConfigError

EXTRAS = {"boto3": "s3", "botocore": "s3", "optuna": "sweep", "litdata": "streaming"}
MISSING_MODULE = re.compile(r"No module named '([\w.]+)'")


class MissingExtra(ConfigError):
    """An optional feature was asked for without the package it needs."""


def install_line(module: str) -> str:
    """What to run: the project's extra, or the package itself."""
    package = module.split(".")[0]
    return f"pip install -e '.[{EXTRAS[package]}]' in the project (or pip install {package})"


def require(module: str, feature: str) -> ModuleType:
    """`module`, imported; MissingExtra naming the install when it is not installed."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] != module.split(".")[0]:
            raise  # something the package itself needs: its own error says what
        package = module.split(".")[0]
        raise MissingExtra(f"{feature} needs {package}, which is not installed: {install_line(module)}") from None


def missing_extra(message: str) -> str | None:
    """For an error that says an optional package is missing (a data module of the project importing it at
    the top, say), the line that names its install; None for any other error."""
    found = MISSING_MODULE.search(message)
    if found is None or found.group(1).split(".")[0] not in EXTRAS:
        return None
    return f"{found.group(1).split('.')[0]} is not installed: {install_line(found.group(1))}"
