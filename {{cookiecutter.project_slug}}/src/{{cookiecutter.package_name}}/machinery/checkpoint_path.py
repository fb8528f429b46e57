"""`ckpt_path` checked before LightningCLI loads it: missing files and files that are not checkpoints refused."""

import pickle
import zipfile
from pathlib import Path

import torch

from .checkpoint_io import refusal_reason
from .errors import ConfigError

CHECKPOINT_ALIASES = ("last", "best", "hpc")


def check_checkpoint_path(ckpt_path: str | None) -> None:
    """Refuse a checkpoint path that is missing or not a checkpoint before anything is written."""
    if ckpt_path is None or ckpt_path in CHECKPOINT_ALIASES or "://" in ckpt_path:
        return
    if not Path(ckpt_path).is_file():
        raise ConfigError(f"ckpt_path {ckpt_path} does not exist")
    if not zipfile.is_zipfile(ckpt_path):
        raise ConfigError(f"ckpt_path {ckpt_path} is not a checkpoint (torch.save writes zip archives)")
    try:  # memory-mapped: only the pickled structure is read, not the tensors
        torch.load(ckpt_path, weights_only=True, mmap=True, map_location="cpu")
    except pickle.UnpicklingError as error:
        raise ConfigError(f"refused to load ckpt_path {ckpt_path}: {refusal_reason(error)}") from None
