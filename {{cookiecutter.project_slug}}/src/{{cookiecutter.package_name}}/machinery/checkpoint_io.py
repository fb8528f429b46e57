"""Checkpoint files written atomically, and the reason torch gives for refusing to load one."""

import os
import pickle
import uuid
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO

from .errors import ConfigError


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write each checkpoint to a temporary file beside it, fsync, then rename it into place.

    A reader (or a restarted job) sees the old file or the new one, never half of one, even on
    network filesystems where Lightning's own save (via the system temp dir) is a plain copy.
    Loading uses `weights_only=True` unless asked otherwise: a checkpoint cannot run code.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Created as open() creates any file (0666 less the umask), not private as tempfile would.
        temporary_path = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
        with open(temporary_path, "xb") as temporary:
            try:
                torch.save(checkpoint, temporary)
                temporary.flush()
                os.fsync(temporary.fileno())
            except BaseException:
                os.unlink(temporary_path)
                raise
        os.replace(temporary_path, path)
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)  # make the rename itself durable
        finally:
            os.close(directory)

    def load_checkpoint(self, path: str | Path, map_location: Any = None, weights_only: bool | None = None) -> Any:
        try:
            return super().load_checkpoint(path, map_location, weights_only=weights_only is not False)
        except pickle.UnpicklingError as error:
            raise ConfigError(f"refused to load {path}: {refusal_reason(error)}") from None


def refusal_reason(error: pickle.UnpicklingError) -> str:
    """Why torch.load(weights_only=True) refused a file, in one line."""
    blocked = [line.strip() for line in str(error).splitlines() if "GLOBAL" in line]
    detail = blocked[0] if blocked else str(error).splitlines()[0]
    return f"it holds objects other than tensors and plain data, which could run code ({detail})"
