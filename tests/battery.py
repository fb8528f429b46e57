"""The failure battery's tools: run the generated project as a user would and read how it ended."""

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .launch_runs import launch_environment


@dataclass(frozen=True)
class Ending:
    """How a run ended: its exit status, how long it took, and what it printed."""

    code: int
    seconds: float
    stdout: str
    stderr: str

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("error:")]

    def tail(self, characters: int = 4000) -> str:
        return f"exit {self.code} after {self.seconds:.1f} s\n{self.stdout[-characters:]}\n{self.stderr[-characters:]}"


def run_project(project: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 120) -> Ending:
    """`python train.py ARGS` in the generated project, with only the given cluster variables."""
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "train.py", *args],
        cwd=project,
        env=env or launch_environment(project),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return Ending(result.returncode, time.monotonic() - started, result.stdout, result.stderr)


def assert_refused(ending: Ending, code: int, message: str, within: float, first: bool = True) -> None:
    """Exit `code` within `within` seconds, with exactly one `error:` line naming `message` and no traceback.

    `first`: the error line is the first thing the run printed (input checked before anything starts).
    """
    assert ending.code == code, ending.tail()
    assert ending.seconds < within, ending.tail()
    assert len(ending.error_lines) == 1 and message in ending.error_lines[0], ending.tail()
    if first:
        assert ending.stderr.lstrip().startswith("error:"), f"something came before the error line:\n{ending.tail()}"
    assert "Traceback" not in ending.stderr, ending.tail()
