"""Which checkpoint `ckpt_path: last` resumes from: the newest one in the run's checkpoint directories that is whole.

Lightning's own `last` takes the newer of last.ckpt and the preemption checkpoint, and when that
file is damaged (a node that died mid-write on a file system without atomic renames, a disk that
filled up) every restart ends in a torch traceback, although an older good checkpoint lies beside
it. Here every checkpoint in those directories is a candidate, newest first. A damaged one is set
aside under another name, with one line that says why, and the next one is tried.
"""

import logging
import pickle
import time
import warnings
import zipfile
from collections.abc import Iterable
from pathlib import Path

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_info

from .checkpoint_disk import checkpoint_dirs
from .checkpoint_io import refusal_reason
from .errors import ConfigError

log = logging.getLogger(__package__)


def resume_checkpoint(trainer: Trainer) -> Path | None:
    """The checkpoint a restarted job resumes from, or None on the job's first run."""
    directories = checkpoint_dirs(trainer)
    checkpoint = newest_whole_checkpoint(directories)
    if checkpoint is None:
        rank_zero_info(f"no checkpoint in {', '.join(map(str, directories))}: training from the start")
        # Lightning would add a warning that suggests `save_last=True`, which is not the way here.
        warnings.filterwarnings("ignore", message=r".*ckpt_path=\"last\"\) is set, but there is no last checkpoint")
    return checkpoint


def newest_whole_checkpoint(directories: Iterable[Path]) -> Path | None:
    candidates = {path: _modified(path) for directory in directories for path in Path(directory).glob("*.ckpt")}
    for path in sorted(candidates, key=candidates.__getitem__, reverse=True):
        try:
            problem = damage(path)
        except FileNotFoundError:
            continue  # set aside meanwhile by another process of the job: it found it damaged too
        except pickle.UnpicklingError as error:
            raise ConfigError(
                f"refused to resume from {path}: {refusal_reason(error)}; if you trust it, pass it as --ckpt_path"
                " with --weights_only false"
            ) from None
        if problem is None:
            return path
        set_aside(path, problem)
    return None


def damage(path: Path) -> str | None:
    """What is wrong with the checkpoint file at `path`, or None when it is whole.

    Every byte is checked against the checksums the zip archive keeps (torch.load itself would
    load zeroed weights without a word), then the pickled structure is read without the tensors.
    A file that holds objects other than tensors and plain data is not damaged: torch's refusal is raised.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            broken = archive.testzip()
        if broken is not None:
            return f"{broken} does not match its checksum"
        checkpoint = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
    except (FileNotFoundError, pickle.UnpicklingError):
        raise  # not damage: the file is gone, or it holds code
    except (zipfile.BadZipFile, RuntimeError, OSError, EOFError, ValueError) as error:
        return str(error).splitlines()[0] if str(error) else type(error).__name__
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        return "it holds no model weights (state_dict)"
    return None


def set_aside(path: Path, problem: str) -> None:
    """Rename a damaged checkpoint so that no later run tries it again, keeping it for inspection."""
    kept = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        path.rename(kept)
    except FileNotFoundError:
        return  # another process of the job set it aside first, and said so
    log.warning(f"skipped {path}: it is damaged ({problem}); kept as {kept.name}")


def _modified(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0  # set aside meanwhile: tried last, and skipped
