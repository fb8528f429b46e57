"""Lines the libraries print on every run that tell a researcher of this project nothing they can act on."""

import logging
import warnings

# Where Lightning's rank_zero_info lines are logged (the fabric's and the trainer's utilities).
LIGHTNING_INFO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


class _LeaveOutTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("💡 Tip:")  # an advertisement for Lightning's hosted logger


def quiet_library_noise() -> None:
    # Lightning's own call of a torch API that torch 2.10 deprecated: nothing a project can change.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    for name in LIGHTNING_INFO_LOGGERS:
        logging.getLogger(name).addFilter(_LeaveOutTips())
