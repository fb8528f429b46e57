"""A project's configs composed as `train.py` composes them, in the test's own process: quick enough to check
every config on every change (a process of its own would import torch and Lightning again for each)."""

import io
import sys
from contextlib import redirect_stderr, redirect_stdout
from unittest.mock import patch

import pytest

from trainkit.cli import main


def print_config(*args: str) -> str:
    """What `train.py ARGS --print_config` prints: the whole configuration in force, with every class imported.
    A config that does not compose fails the test with train.py's own error line."""
    printed, errors = io.StringIO(), io.StringIO()
    with (
        patch.object(sys, "argv", ["train.py"]),  # pytest's own arguments are not train.py's
        redirect_stdout(printed),
        redirect_stderr(errors),
        pytest.raises(SystemExit) as ended,
    ):
        main([*args, "--print_config"])
    assert ended.value.code in (0, None), errors.getvalue()[-3000:]
    return printed.getvalue()
