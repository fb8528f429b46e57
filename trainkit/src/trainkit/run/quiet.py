"""Lines the libraries print on every run that tell a researcher of this project nothing they can act on."""

import logging
import warnings
from dataclasses import dataclass

# Where Lightning's rank_zero_info lines are logged (the fabric's and the trainer's utilities).
LIGHTNING_INFO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


@dataclass(frozen=True)  # compared by `words`: a logger keeps one of each, however often it is added
class LeaveOut:
    """Leaves out the lines that contain `words`."""

    words: str

    def filter(self, record: logging.LogRecord) -> bool:
        return self.words not in record.getMessage()


def leave_out_lightning_lines(words: str) -> None:
    """From now on, in this process, Lightning's rank-zero info lines that contain `words` are not printed."""
    for name in LIGHTNING_INFO_LOGGERS:
        logging.getLogger(name).addFilter(LeaveOut(words))


def quiet_library_noise() -> None:
    # Lightning's own call of a torch API that torch 2.10 deprecated: nothing a project can change.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    leave_out_lightning_lines("💡 Tip:")  # an advertisement for Lightning's hosted logger
