"""Which checkpoint `ckpt_path: last` resumes from: the newest one in the run's checkpoint directories that is whole.

Lightning's own `last` takes the newer of last.ckpt and the preemption checkpoint, and when that
file is damaged (a node that died mid-write on a file system without atomic renames, a disk that
filled up) every restart ends in a torch traceback, although an older good checkpoint lies beside
it. Here every checkpoint in those directories is a candidate, newest first. A damaged one is set
aside under another name, with one line that says why, and the next one is tried.

With a checkpoint store (stored_checkpoints.py), a checkpoint there that is newer than any on this
disk (a new node or container, a fresh disk) is downloaded into the checkpoint directory first:
the one the store's `latest` pointer names, checked against the pointer's hash, else the newest
whole one.
"""

import logging
import os
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
from .object_store import ObjectStore
from .stored_checkpoints import FOLDER, POINTER, StoredCheckpointIO, sha256_of, step_of

log = logging.getLogger(__package__)


def resume_checkpoint(trainer: Trainer) -> Path | None:
    """The checkpoint a restarted job resumes from, or None on the job's first run."""
    directories = checkpoint_dirs(trainer)
    checkpoint = newest_whole_checkpoint(directories)
    io = trainer.strategy.checkpoint_io
    if isinstance(io, StoredCheckpointIO) and directories:
        local_step = -1 if checkpoint is None else _global_step(checkpoint)
        checkpoint = newer_from_store(io.store, directories[0], local_step) or checkpoint
    if checkpoint is None:
        where = [*map(str, directories), *([io.store.url] if isinstance(io, StoredCheckpointIO) else [])]
        rank_zero_info(f"no checkpoint in {', '.join(where)}: training from the start")
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


def newer_from_store(store: ObjectStore, directory: Path, local_step: int) -> Path | None:
    """Download the store's newest whole checkpoint into `directory` if it is newer than `local_step`."""
    found = store.read_json(POINTER)
    pointer = found[0] if found else {}
    names = sorted((name for name in store.names(FOLDER) if name.endswith(".ckpt")), key=step_of, reverse=True)
    if "checkpoint" in pointer:  # the newest whole one, unless something happened to it since
        names = [pointer["checkpoint"], *(name for name in names if name != pointer["checkpoint"])]
    for name in names:
        step = step_of(name)
        if step <= local_step:
            return None
        pointed = name == pointer.get("checkpoint")
        file = pointer["file"] if pointed else Path(name).name
        downloaded = download_checkpoint(store, name, directory / file, pointer.get("sha256") if pointed else None)
        if downloaded is not None:
            rank_zero_info(f"resuming from {store.where(name)} (step {step}), newer than any checkpoint in {directory}")
            return downloaded
    return None


def download_checkpoint(store: ObjectStore, name: str, target: Path, sha256: str | None = None) -> Path | None:
    """The store's checkpoint `name` as the file `target`, or None (with one line) when it is damaged or gone."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # Each process downloads its own copy and renames it into place: processes sharing the directory agree.
    partial = target.with_name(f".{target.name}.download-{os.getpid()}")
    try:
        store.download(name, partial)
        damaged = "its hash differs from the one the pointer names" if sha256 and sha256_of(partial) != sha256 else None
        try:
            damaged = damaged or damage(partial)
        except pickle.UnpicklingError as error:
            raise ConfigError(f"refused to resume from {store.where(name)}: {refusal_reason(error)}") from None
        if damaged is None:
            os.replace(partial, target)
            return target
        problem = f"it is damaged ({damaged})"
    except FileNotFoundError:
        problem = "it is gone from the store"
    finally:
        partial.unlink(missing_ok=True)
    log.warning(f"skipped {store.where(name)}: {problem}")
    return None


def _global_step(path: Path) -> int:
    return int(torch.load(path, weights_only=True, mmap=True, map_location="cpu").get("global_step", 0))


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
