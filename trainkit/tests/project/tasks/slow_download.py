"""The tests' tiny data, with a download that keeps one node busy for a while: for the drills of a node that
stalls while the job prepares its data."""

import os
import time
from pathlib import Path

from trainkit.testing.tiny import TinyDataModule


class SlowDownload(TinyDataModule):
    """On node `slow_node`, `prepare_data` writes its pid to `marker` and then computes for `seconds`, in Python,
    as an unzip or a checksum of a large download would."""

    def __init__(self, marker: str, seconds: float, slow_node: int = 1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.marker, self.seconds, self.slow_node = Path(marker), seconds, slow_node

    def prepare_data(self) -> None:
        if self.trainer.node_rank != self.slow_node:
            return
        self.marker.write_text(str(os.getpid()))
        deadline = time.monotonic() + self.seconds
        while time.monotonic() < deadline:
            sum(range(10_000))
