"""The disk the checkpoints go to: checked before training, and a write it refuses ends the job in one line.

A fit finds out that its checkpoint directory is read-only, or too full for one checkpoint, before it
trains, not at the end of its first epoch. When a write fails mid-run anyway (the disk filled up
since), the node's first process reports it (checkpoint_io.CheckpointNotWritten, one line and exit
status 74 from cli.py) and ends the processes it started, which wait for it in the save.
"""

import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path

from jsonargparse import Namespace
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint

from trainkit.checkpoints.io import CheckpointNotWritten
from trainkit.checkpoints.sharded_format import checkpoint_size
from trainkit.run.config import class_of, configured
from trainkit.run.errors import ConfigError

# A checkpoint holds the weights and the optimizer's state (Adam keeps two more tensors per weight),
# and the state of the loops, callbacks and random number generators: 20 KB in the tests' tiny one.
CHECKPOINT_PER_MODEL_BYTES = 3
CHECKPOINT_OTHER_BYTES = 64_000


def refuse_unwritable_checkpoint_dirs(trainer: Namespace) -> None:
    """Before anything writes there (each process writes the wandb run id beside the checkpoints)."""
    checkpoints = [callback for callback in configured(trainer.callbacks) if _is_checkpoint(callback)]
    for directory in sorted({callback.init_args.get("dirpath") for callback in checkpoints} - {None}):
        if "://" in directory:
            continue  # object storage: not a disk of this machine
        problem = unwritable(Path(directory))
        if problem:
            raise ConfigError(problem)


class CheckCheckpointDisk(Callback):
    """Refuse a fit whose checkpoints would not fit on the disk; end the node quietly when a write fails."""

    def __init__(self) -> None:
        self.refused = False

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit" or trainer.fast_dev_run:  # a fast_dev_run writes no checkpoints
            return
        problem = None
        if trainer.is_global_zero:  # the process that writes the checkpoints, on its disk
            directories = checkpoint_dirs(trainer)
            needed = checkpoint_bytes(directories, pl_module)
            problem = next(filter(None, (short_of_room(directory, needed) for directory in directories)), None)
        # Every process refuses alike, instead of waiting for the first one in the next collective.
        problem = trainer.strategy.broadcast(problem)
        if problem:
            self.refused = True
            raise ConfigError(problem)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # The job's first process says why, once. The processes it started end now, without a word:
        # they refused too, or wait for its failed save. Lightning's watcher would kill this process
        # as soon as they exit: they leave its watch list first.
        if self.refused or isinstance(exception, CheckpointNotWritten):
            watched = getattr(trainer.strategy.launcher, "procs", [])
            started: list[subprocess.Popen] = list(watched)
            watched.clear()
            for process in started:
                process.kill()
                process.wait()


def _is_checkpoint(callback: Namespace) -> bool:
    return isinstance(callback, Namespace) and issubclass(class_of(callback.class_path), Checkpoint)


def checkpoint_dirs(trainer: Trainer) -> list[Path]:
    dirpaths = {getattr(callback, "dirpath", None) for callback in trainer.checkpoint_callbacks}
    # Resolved: one directory may be named relative by one callback and absolute by another.
    return sorted({Path(dirpath).resolve() for dirpath in dirpaths if dirpath and "://" not in str(dirpath)})


def newest_checkpoint(directories: Iterable[Path]) -> Path | None:
    checkpoints = [path for directory in directories for path in Path(directory).glob("*.ckpt")]
    return max(checkpoints, key=lambda path: path.stat().st_mtime, default=None)


def checkpoint_bytes(directories: Iterable[Path], model: LightningModule) -> int:
    """About how large a checkpoint of this run is: the newest one so far (all of a sharded one's files, which
    every process writes to the same directory), or else from the model's size."""
    newest = newest_checkpoint(directories)
    if newest is not None:
        return checkpoint_size(newest)
    tensors = [*model.parameters(), *model.buffers()]
    model_bytes = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
    return CHECKPOINT_PER_MODEL_BYTES * model_bytes + CHECKPOINT_OTHER_BYTES


def unwritable(directory: Path) -> str | None:
    """Why no file can be created in `directory` (created if missing), or None."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as error:
        return (
            f"checkpoint directory {directory} is not writable ({error.strerror}): fix its permissions or mount,"
            " or point trainer.default_root_dir elsewhere"
        )
    return None


def short_of_room(directory: Path, needed: int) -> str | None:
    """Why a checkpoint of `needed` bytes does not fit in `directory`, or None. Written beside the old one, it
    needs room of its own until it replaces it."""
    existing = next(folder for folder in (directory, *directory.parents) if folder.exists())
    free = shutil.disk_usage(existing).free
    if free >= needed:
        return None
    return (
        f"checkpoint directory {directory} has only {size(free)} free, a checkpoint needs about {size(needed)}:"
        " make room, or point trainer.default_root_dir at a disk with more"
    )


def size(count: float) -> str:
    """A number of bytes in the units `df -h --si` uses."""
    units = ["bytes", "KB", "MB", "GB", "TB"]
    while count >= 1000 and len(units) > 1:
        count /= 1000
        units.pop(0)
    return f"{count:.0f} bytes" if units[0] == "bytes" else f"{count:.1f} {units[0]}"
