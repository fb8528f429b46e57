"""Which checkpoint `ckpt_path: last` resumes from: the newest one in the run's checkpoint directories that is whole.

Lightning's own `last` takes the newer of last.ckpt and the preemption checkpoint, and when that
file is damaged (a node that died mid-write on a file system without atomic renames, a disk that
filled up) every restart ends in a torch traceback, although an older good checkpoint lies beside
it. Here every checkpoint in those directories is a candidate, newest first: a file, or a directory
that the sharded strategy saved and marked complete (checkpoints/sharded_format.py). A damaged one is set
aside under another name, with one line that says why, and the next one is tried.

The sharded strategy puts a new checkpoint in place of the old one with two renames (strategies/sharded.py); a
job killed between them leaves its newest checkpoint only under a hidden name. The renames are
finished first, so that it is a candidate under its own name.

With a checkpoint store (checkpoints/stored.py), a checkpoint there that is newer than any on this
disk (a new node or container, a fresh disk) is downloaded into the checkpoint directory first:
the one the store's `latest` pointer names, checked against the pointer's hash, else the newest
whole one. A sharded one is downloaded by every process into a hidden directory of its own and
renamed into place: the first rename wins, and processes sharing the directory use that one.
"""

import hashlib
import json
import logging
import os
import pickle
import re
import shutil
import time
import warnings
import zipfile
from collections.abc import Iterable
from pathlib import Path

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_info

from trainkit.checkpoints.disk import checkpoint_dirs
from trainkit.checkpoints.io import PLAIN_DATA, hidden_name_beside, refusal_reason
from trainkit.checkpoints.sharded_format import COMMIT_MARKER, checkpoint_meta, is_sharded, sharded_damage
from trainkit.checkpoints.stored import POINTER, StoredCheckpointIO, sha256_of, step_of, stored_versions
from trainkit.run.errors import ConfigError
from trainkit.store.object_store import ObjectStore

log = logging.getLogger(__package__)

# Where the sharded strategy saves `NAME.ckpt` before it renames it into place, and keeps the older one meanwhile.
SWAPPED = re.compile(r"\.(?P<name>.+\.ckpt)\.(?:partial|old)-\w+")


def resume_checkpoint(trainer: Trainer) -> Path | None:
    """The checkpoint a restarted job resumes from, or None on the job's first run."""
    checkpoint = own_checkpoint(trainer)
    if checkpoint is None:
        io = trainer.strategy.checkpoint_io
        where = [*map(str, checkpoint_dirs(trainer)), *([io.store.url] if isinstance(io, StoredCheckpointIO) else [])]
        rank_zero_info(f"no checkpoint in {', '.join(where)}: training from the start")
        # Lightning would add a warning that suggests `save_last=True`, which is not the way here.
        warnings.filterwarnings("ignore", message=r".*ckpt_path=\"last\"\) is set, but there is no last checkpoint")
    return checkpoint


def quiet_about_a_directory_without_checkpoints(trainer: Trainer) -> None:
    """Lightning warns that checkpoints/ "exists and is not empty" where it holds no checkpoint, only the wandb run
    id the kit keeps there from the run's start (tracking/wandb_logger.py): a fresh run told not to resume, a
    sweep's run. Where it holds checkpoints and the run does not resume from them, the warning stands."""
    if not any(any(Path(directory).glob("*.ckpt")) for directory in checkpoint_dirs(trainer)):
        warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")


def own_checkpoint(trainer: Trainer) -> Path | None:
    """The run's newest whole checkpoint, in its checkpoint directories or its store; None where it has none."""
    # Lightning warns that checkpoints/ "exists and is not empty": resuming, it holds this run's own files.
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
    directories = checkpoint_dirs(trainer)
    for directory in directories:
        finish_interrupted_swaps(directory)
    checkpoint = newest_whole_checkpoint(directories)
    io = trainer.strategy.checkpoint_io
    if isinstance(io, StoredCheckpointIO) and directories:
        local_step = -1 if checkpoint is None else _global_step(checkpoint)
        checkpoint = newer_from_store(io.store, directories[0], local_step) or checkpoint
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
                f"refused to resume from {path}: {refusal_reason(error)}; {PLAIN_DATA}; to resume from this file"
                " once, if you trust it, pass it as --ckpt_path with --weights_only false"
            ) from None
        if problem is None:
            return path
        set_aside(path, problem)
    return None


def finish_interrupted_swaps(directory: Path) -> None:
    """Rename a sharded checkpoint left under a hidden name into place, where its own name is missing.

    Only complete ones (with the commit marker): an unfinished save is not a checkpoint, and the
    strategy removes it at its next save. Each process of the job may try; one of them renames it.
    """
    hidden = [path for path in directory.glob(".*.ckpt.*-*") if SWAPPED.fullmatch(path.name)]
    committed = [path for path in hidden if (path / COMMIT_MARKER).is_file()]
    for path in sorted(committed, key=_modified, reverse=True):  # the newest save first
        target = path.with_name(SWAPPED.fullmatch(path.name)["name"])
        if target.exists():
            continue  # in place already, maybe by another process of the job
        try:
            problem = damage(path)
        except FileNotFoundError:
            continue  # renamed meanwhile by another process of the job
        except pickle.UnpicklingError:
            problem = None  # it holds code: refused below, under its own name, as any checkpoint is
        if problem is not None:
            set_aside(path, problem)
            continue
        try:
            path.rename(target)
        except OSError:
            if target.exists():
                continue  # another process renamed it (or an older one) first
            raise
        log.info(f"finished a save that was interrupted between its two renames: {path.name} is now {target}")


def newer_from_store(store: ObjectStore, directory: Path, local_step: int) -> Path | None:
    """Download the store's newest whole checkpoint into `directory` if it is newer than `local_step`."""
    found = store.read_json(POINTER)
    pointer = found[0] if found else {}
    names = sorted(stored_versions(store), key=step_of, reverse=True)
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


class _Damaged(Exception):
    """What is wrong with a checkpoint in the store, which is skipped."""


def download_checkpoint(store: ObjectStore, name: str, target: Path, sha256: str | None = None) -> Path | None:
    """The store's checkpoint `name` on this disk, or None (with one line) when it is damaged or gone.

    It becomes `target`, unless `target` is another checkpoint that one rename cannot replace (a
    directory; for a sharded checkpoint, a file too): then it goes beside it, under its stored name.
    `sha256` is the pointer's: of the file, or of a sharded checkpoint's commit marker.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        if any(found.startswith(f"{name}/") for found in store.names(name)):
            return _download_sharded(store, name, target, sha256)
        if target.is_dir():  # a sharded checkpoint of that name: the stored file goes beside it
            target = target.with_name(Path(name).name)
        return _download_file(store, name, target, sha256)
    except FileNotFoundError:
        problem = "it is gone from the store"
    except _Damaged as error:
        problem = f"it is damaged ({error})"
    log.warning(f"skipped {store.where(name)}: {problem}")
    return None


def _download_file(store: ObjectStore, name: str, target: Path, sha256: str | None) -> Path:
    # Each process downloads its own copy and renames it into place: processes sharing the directory agree.
    partial = hidden_name_beside(target, "download-")
    try:
        store.download(name, partial)
        if sha256 and sha256_of(partial) != sha256:
            raise _Damaged("its hash differs from the one the pointer names")
        _check(store, name, partial)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def _download_sharded(store: ObjectStore, name: str, target: Path, sha256: str | None) -> Path:
    """The sharded checkpoint stored as objects `name/<file>` as a directory: the files its commit marker lists."""
    found = store.read(f"{name}/{COMMIT_MARKER}")
    if found is None:
        raise _Damaged(f"it has no {COMMIT_MARKER} marker: its upload, or its deletion, was cut short")
    marker = found[0]
    if sha256 and hashlib.sha256(marker).hexdigest() != sha256:
        raise _Damaged(f"its {COMMIT_MARKER} marker's hash differs from the one the pointer names")
    if target.exists() and not _holds(target, marker):
        target = target.with_name(Path(name).name)  # another checkpoint of that name: this one goes beside it
    if _holds(target, marker):
        return target  # downloaded already by another process of the job, which checked it
    try:
        files = list(json.loads(marker)["files"])
    except (ValueError, KeyError, TypeError):
        files = []  # the check below says what is wrong with the marker
    partial = hidden_name_beside(target, "download-")
    try:
        partial.mkdir()
        (partial / COMMIT_MARKER).write_bytes(marker)
        for file in files:
            if Path(file).name != file or file == COMMIT_MARKER:
                raise _Damaged(f"its {COMMIT_MARKER} marker lists {file!r}, which is not a file of a checkpoint")
            try:
                store.download(f"{name}/{file}", partial / file)
            except FileNotFoundError:
                raise _Damaged(f"{file} is missing from the store") from None
        _check(store, name, partial)
        try:
            partial.rename(target)
        except OSError:
            if not _holds(target, marker):
                raise
            # Another process of the job renamed its copy into place first: this one is dropped.
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def _check(store: ObjectStore, name: str, downloaded: Path) -> None:
    try:
        problem = damage(downloaded)
    except pickle.UnpicklingError as error:
        refused = refusal_reason(error)
        raise ConfigError(f"refused to resume from {store.where(name)}: {refused}; {PLAIN_DATA}") from None
    if problem is not None:
        raise _Damaged(problem)


def _holds(directory: Path, marker: bytes) -> bool:
    """Whether `directory` is the sharded checkpoint whose commit marker is `marker`."""
    try:
        return (directory / COMMIT_MARKER).read_bytes() == marker
    except OSError:  # not there, not a directory, or without a marker
        return False


def _global_step(path: Path) -> int:
    return int(checkpoint_meta(path).get("global_step", 0))


def damage(path: Path) -> str | None:
    """What is wrong with the checkpoint at `path`, or None when it is whole.

    Every byte of a file is checked against the checksums the zip archive keeps (torch.load itself
    would load zeroed weights without a word), then the pickled structure is read without the tensors.
    A sharded checkpoint's files must be those its commit marker lists, and its meta.pt must load.
    A file that holds objects other than tensors and plain data is not damaged: torch's refusal is raised.
    """
    if is_sharded(path):
        return _sharded_damage(path)
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


def _sharded_damage(directory: Path) -> str | None:
    problem = sharded_damage(directory)
    if problem is not None:
        return problem
    try:
        checkpoint_meta(directory)
    except pickle.UnpicklingError:
        raise  # it holds code
    except (RuntimeError, OSError, EOFError, ValueError) as error:
        return f"its meta.pt is damaged ({str(error).splitlines()[0] if str(error) else type(error).__name__})"
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
