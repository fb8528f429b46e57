"""A line now and then while a job waits to form, so that a log that has stopped is not taken for a hang.

A node waits for the main node's name to resolve and for the other nodes and processes to check in,
for minutes when the platform is slow to start them. Each wait says what it waits for, and how long
it will.
"""

import logging
import time

log = logging.getLogger(__name__)

EVERY_SECONDS = 60.0


class Reminder:
    """Due once `EVERY_SECONDS` have passed since it was made, and again each time as many pass."""

    def __init__(self) -> None:
        self._due_at = time.monotonic() + EVERY_SECONDS

    def due(self) -> bool:
        if time.monotonic() < self._due_at:
            return False
        self._due_at = time.monotonic() + EVERY_SECONDS
        return True
