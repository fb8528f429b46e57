"""Checkpoint files written atomically, in the background if asked, a failed write named in one line, and why torch
refuses to load one."""

import copy
import logging
import os
import pickle
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from torch import Tensor

from trainkit.checkpoints.saving import CheckpointSavingSettings, SaveTimes
from trainkit.run.errors import ConfigError

log = logging.getLogger(__package__)
# What a model or callback that keeps other objects in its checkpoints can do, so that `weights_only` loads them.
PLAIN_DATA = ("save numbers, texts and tensors (float(x) for a numpy number, str(p) for a Path), or allow its class"
              " with torch.serialization.add_safe_globals")  # fmt: skip


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write each checkpoint to a temporary file beside it, fsync, then rename it into place.

    A reader (or a restarted job) sees the old file or the new one, never half of one, even on
    network filesystems where Lightning's own save (via the system temp dir) is a plain copy.
    A write the file system refuses (a full disk) leaves the old file as it was and raises
    CheckpointNotWritten, which the command line reports in one line (exit_codes.CANNOT_WRITE).
    Loading uses `weights_only=True` unless asked otherwise: a checkpoint cannot run code.

    With `saving.asynchronous`, a save copies the checkpoint into CPU memory and returns; one
    background thread writes it, one checkpoint at a time. A write that failed is raised at the
    next save, by `wait_for_checkpoints()`, or when the run ends (teardown).

    The run's first checkpoint is read back for objects that `weights_only` refuses (a numpy number
    a model keeps): a job resuming by itself would stop there, so the run says so at once.
    """

    def __init__(self, saving: CheckpointSavingSettings | None = None) -> None:
        self.saving = saving or CheckpointSavingSettings()
        self.times = SaveTimes(self.saving.grace_seconds)
        self._writer: ThreadPoolExecutor | None = None
        self._writing: Future | None = None  # the write in flight, if any
        self._checked = False  # whether a written checkpoint was read back for what weights_only refuses

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        path = Path(path)
        started = time.monotonic()
        if not self.saving.asynchronous:
            self._write(checkpoint, path)
            waited = time.monotonic() - started
            self.times.report(path, waited, waited)
            return
        self.wait_for_checkpoints()  # one write at a time: memory for one copy, files written in order
        # Training changes the weights in place as soon as this returns: the copy is what gets written.
        copied = copy_to_cpu(checkpoint)
        waited = time.monotonic() - started
        if self._writer is None:  # its thread is waited for at exit too: a process ending early still writes
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-write")
        self._writing = self._writer.submit(self._write_in_background, copied, path, waited)

    def wait_for_checkpoints(self) -> None:
        """Return once every checkpoint saved so far is written; raise CheckpointNotWritten if one is not."""
        writing, self._writing = self._writing, None
        if writing is not None:
            writing.result()  # raises the write's error here, once

    def teardown(self) -> None:
        ending_with_an_error = sys.exc_info()[0] is not None
        try:
            self.wait_for_checkpoints()
        except CheckpointNotWritten as error:
            if not ending_with_an_error:
                raise
            # The run is already ending with another error (Lightning tears down while handling it): say this one too.
            log.error(f"error: {error}")

    def load_checkpoint(self, path: str | Path, map_location: Any = "cpu", weights_only: bool | None = None) -> Any:
        # Onto the CPU, as Lightning's own loads do. torch alone puts each tensor back on the device it was saved
        # from (cuda:0 for a GPU run's rank 0): a machine without a GPU cannot, and on a GPU node every process would
        # load its copy onto the first GPU. Lightning copies the weights and optimizer state to each process's own.
        try:
            return super().load_checkpoint(path, map_location, weights_only=weights_only is not False)
        except pickle.UnpicklingError as error:
            raise ConfigError(f"refused to load {path}: {refusal_reason(error)}") from None

    def written(self, path: Path, step: int) -> None:
        """Called once the checkpoint for `step` is in place at `path` (in the background thread when asynchronous)."""

    def _write_in_background(self, checkpoint: dict[str, Any], path: Path, waited: float) -> None:
        started = time.monotonic()
        self._write(checkpoint, path)
        self.times.report(path, waited, time.monotonic() - started)

    def _write(self, checkpoint: dict[str, Any], path: Path) -> None:
        try:
            _write_atomically(checkpoint, path)
        except Exception as error:
            refusal = os_error_behind(error)
            if refusal is None:
                raise  # not the disk: a bug, such as an object torch cannot save
            raise CheckpointNotWritten(path, refusal.strerror or str(refusal)) from error
        if not self._checked:
            self._checked = True
            warn_if_refused_on_resume(path)
        self.written(path, int(checkpoint.get("global_step", 0)))


class CheckpointNotWritten(Exception):
    """The file system refused a checkpoint (a full disk, a read-only or lost mount); the older ones are intact."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(
            f"could not write checkpoint {path}: {reason}; the checkpoints written before it are intact: fix the disk"
            " and run the same command again to resume"
        )
        self.path = path
        self.reason = reason


def copy_to_cpu(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A copy of `checkpoint` that nothing in training shares: every tensor copied into CPU memory (a CPU tensor
    too), and the dicts and lists around them copied (callbacks keep changing theirs, e.g. the best scores)."""
    copies = {id(tensor): tensor.detach().to("cpu", copy=True) for tensor in _tensors(checkpoint)}
    return copy.deepcopy(checkpoint, memo=copies)  # deepcopy takes each tensor's copy from the memo


def _tensors(value: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)


def hidden_name_beside(path: Path, purpose: str = "") -> Path:
    """A hidden name in `path`'s directory that no other process picks, also one on another node sharing the
    directory (a pid would repeat there: the first process of every container is 1)."""
    return path.with_name(f".{path.name}.{purpose}{uuid.uuid4().hex[:8]}")


def _write_atomically(checkpoint: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Created as open() creates any file (0666 less the umask), not private as tempfile would.
    temporary_path = hidden_name_beside(path)
    with open(temporary_path, "xb") as temporary:
        try:
            torch.save(checkpoint, temporary)
            temporary.flush()
            os.fsync(temporary.fileno())
            os.replace(temporary_path, path)
        except BaseException:
            temporary_path.unlink(missing_ok=True)  # a full disk keeps no half-written file
            raise
    fsync(path.parent)  # make the rename itself durable


def fsync(path: Path) -> None:
    """Flush a file, or a directory's entries (a rename in it), to the disk."""
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def os_error_behind(error: BaseException | None) -> OSError | None:
    """The operating system's error that `error` is or comes from: torch reports a failed write as a RuntimeError,
    and torch.distributed.checkpoint as a CheckpointException holding each process's error and traceback."""
    while error is not None and not isinstance(error, OSError):
        for failure in getattr(error, "failures", {}).values():
            found = os_error_behind(failure[0] if isinstance(failure, tuple) else failure)
            if found is not None:
                return found
        error = error.__cause__ or error.__context__
    return error


def warn_if_refused_on_resume(path: Path) -> None:
    """One line if `torch.load(path, weights_only=True)` would refuse the file (its pickle is read, not its tensors)."""
    refused = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))  # in no set order of its own
    if refused:
        log.warning(
            f"checkpoint: {path} holds objects that a job resuming by itself refuses to load ({', '.join(refused)}),"
            f" so a preempted run would not go on: {PLAIN_DATA}"
        )


def refusal_reason(error: pickle.UnpicklingError) -> str:
    """Why torch.load(weights_only=True) refused a file, in one line."""
    blocked = [line.strip() for line in str(error).splitlines() if "GLOBAL" in line]
    detail = blocked[0] if blocked else str(error).splitlines()[0]
    return f"it holds objects other than tensors and plain data, which could run code ({detail})"
