"""Checkpoint files written atomically, a failed write named in one line, and why torch refuses to load one."""

import os
import pickle
import uuid
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO

from .checkpoint_saving import CheckpointSavingSettings
from .errors import ConfigError


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write each checkpoint to a temporary file beside it, fsync, then rename it into place.

    A reader (or a restarted job) sees the old file or the new one, never half of one, even on
    network filesystems where Lightning's own save (via the system temp dir) is a plain copy.
    A write the file system refuses (a full disk) leaves the old file as it was and raises
    CheckpointNotWritten, which the command line reports in one line (exit_codes.CANNOT_WRITE).
    Loading uses `weights_only=True` unless asked otherwise: a checkpoint cannot run code.
    """

    def __init__(self, saving: CheckpointSavingSettings | None = None) -> None:
        self.saving = saving or CheckpointSavingSettings()

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        path = Path(path)
        try:
            _write_atomically(checkpoint, path)
        except Exception as error:
            refusal = _os_error_behind(error)
            if refusal is None:
                raise  # not the disk: a bug, such as an object torch cannot save
            raise CheckpointNotWritten(path, refusal.strerror or str(refusal)) from error

    def load_checkpoint(self, path: str | Path, map_location: Any = None, weights_only: bool | None = None) -> Any:
        try:
            return super().load_checkpoint(path, map_location, weights_only=weights_only is not False)
        except pickle.UnpicklingError as error:
            raise ConfigError(f"refused to load {path}: {refusal_reason(error)}") from None


class CheckpointNotWritten(Exception):
    """The file system refused a checkpoint (a full disk, a read-only or lost mount); the older ones are intact."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(
            f"could not write checkpoint {path}: {reason}; the checkpoints written before it are intact: fix the disk"
            " and run the same command again to resume"
        )
        self.path = path
        self.reason = reason


def _write_atomically(checkpoint: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Created as open() creates any file (0666 less the umask), not private as tempfile would.
    temporary_path = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    with open(temporary_path, "xb") as temporary:
        try:
            torch.save(checkpoint, temporary)
            temporary.flush()
            os.fsync(temporary.fileno())
            os.replace(temporary_path, path)
        except BaseException:
            temporary_path.unlink(missing_ok=True)  # a full disk keeps no half-written file
            raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # make the rename itself durable
    finally:
        os.close(directory)


def _os_error_behind(error: BaseException | None) -> OSError | None:
    """The operating system's error that `error` is or comes from: torch reports a failed write as a RuntimeError."""
    while error is not None and not isinstance(error, OSError):
        error = error.__cause__ or error.__context__
    return error


def refusal_reason(error: pickle.UnpicklingError) -> str:
    """Why torch.load(weights_only=True) refused a file, in one line."""
    blocked = [line.strip() for line in str(error).splitlines() if "GLOBAL" in line]
    detail = blocked[0] if blocked else str(error).splitlines()[0]
    return f"it holds objects other than tensors and plain data, which could run code ({detail})"
