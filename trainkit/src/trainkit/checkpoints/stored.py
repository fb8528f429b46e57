"""Checkpoints kept in an object store too, so that a job restarted on a new node or container resumes.

The first process writes each checkpoint to the run's checkpoints/ directory as always (in the
background too when checkpoint_saving.asynchronous), then, once the file is in place, a
background thread uploads it as checkpoints/<name>-step=<N>.ckpt under the store's URL. Only once
every byte is in the store does the `latest` pointer move to it, with a conditional write: a second
job writing to the same place makes one of them stop instead of both crossing. Then older versions
are deleted: the store keeps the newest `keep` versions of each rolling checkpoint (periodic, last,
preempted), the best ones Lightning keeps on disk, and always the one the pointer names. A job
killed at any moment resumes from the previous complete checkpoint: an upload cut short is never
visible, and the pointer never names one. A best checkpoint whose upload a kill cut short is stored by
the next run on that disk, which still names it as its best.

A sharded checkpoint (a directory, checkpoints/sharded_format.py) is stored as one object per file,
checkpoints/<name>-step=<N>.ckpt/<file>, its commit marker last: a version whose upload was cut
short has no marker, is never resumed from, and is deleted at the next upload. The first process
uploads every shard, since the sharded strategy writes them all to a directory it sees.
"""

import functools
import hashlib
import json
import logging
import os
import queue
import re
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import PositiveFloat, PositiveInt

from trainkit.checkpoints.io import AtomicCheckpointIO, hidden_name_beside
from trainkit.checkpoints.saving import CheckpointSavingSettings
from trainkit.checkpoints.sharded_format import COMMIT_MARKER
from trainkit.store.object_store import ObjectStore, StoreConflict, StoreError

log = logging.getLogger(__package__)

POINTER = "latest"
FOLDER = "checkpoints"
RUN_ID = "wandb-run-id"


@dataclass
class CheckpointStoreSettings:
    """The `checkpoint_store:` section of the config.

    Args:
        url: where checkpoints are kept besides the run's checkpoints/ directory: s3://bucket/prefix
            (gs://, az:// with gcsfs or adlfs installed). None keeps them on this disk only.
        keep: how many versions of each rolling checkpoint (periodic, last, preempted) the store keeps.
        timeout: seconds to wait for each request to the store before retrying it (three tries).
    """

    url: str | None = None
    keep: PositiveInt = 2
    timeout: PositiveFloat = 60.0


class CheckpointNotStored(Exception):
    """The object store refused or lost a checkpoint upload; the checkpoints stored before it are intact."""

    def __init__(self, reason: str, latest: str | None) -> None:
        kept = f"; the newest one stored is {latest}" if latest else ""
        super().__init__(
            f"could not store a checkpoint: {reason}{kept}; the checkpoints on this disk are intact: fix the store"
            " and run the same command again to resume"
        )
        self.reason = reason


class StoredCheckpointIO(AtomicCheckpointIO):
    """AtomicCheckpointIO, plus an upload of every checkpoint to an object store (only the first process saves)."""

    def __init__(self, store: ObjectStore, keep: int = 2, saving: CheckpointSavingSettings | None = None) -> None:
        super().__init__(saving)
        self.store = store
        self.keep = keep
        self.latest: str | None = None  # the URL of the newest checkpoint stored by this run
        self._uploads: queue.Queue[Callable[[], None]] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._starting = threading.Lock()
        self._snapshots_cleared = False
        self._failure: StoreError | None = None
        self._failure_told = False
        self._pointer_version: str | None = None
        self._pointer_read = False

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        self.raise_failure()  # an upload failed since the last save: the job ends now, not hours later
        super().save_checkpoint(checkpoint, path, storage_options)

    def written(self, path: Path, step: int) -> None:
        # Only once the checkpoint is in place (in the background when saving is asynchronous): upload that version.
        if not self._snapshots_cleared:  # the first save of this run: a killed run may have left snapshots behind
            for left in path.parent.glob(".*.upload-*"):
                _remove(left)
            self._snapshots_cleared = True
            # And a best checkpoint it wrote but did not store all of: no later save replaces it, and the resumed
            # run still names it as its best.
            for kept in sorted(path.parent.glob("*step=*.ckpt")):
                if kept == path:
                    continue
                try:
                    self._submit(functools.partial(self._store_unless_stored, _snapshot(kept), kept.name))
                except FileNotFoundError:  # Lightning removed it meanwhile: no longer among the best
                    continue
        snapshot = _snapshot(path)
        self._submit(lambda: self._store(snapshot, path.name, step))

    def remove_checkpoint(self, path: str | Path) -> None:
        super().remove_checkpoint(path)  # Lightning removes a best checkpoint that is no longer among the best
        self._submit(lambda: self._forget(Path(path).name))

    def wait(self) -> None:
        """Return once every checkpoint saved so far is written and in the store; raise CheckpointNotWritten or
        CheckpointNotStored if one is not."""
        self.wait_for_checkpoints()
        self._uploads.join()
        self.raise_failure()

    def raise_failure(self) -> None:
        if self._failure is not None:
            self._failure_told = True
            raise CheckpointNotStored(str(self._failure), self.latest)

    def teardown(self) -> None:
        try:
            super().teardown()  # the last write, whose upload follows
        finally:
            self._uploads.join()
        if self._failure is None or self._failure_told:
            return
        if sys.exc_info()[0] is None:
            self.raise_failure()
        # The run is already ending with another error (Lightning tears down while handling it): say this one too.
        log.error(f"error: {CheckpointNotStored(str(self._failure), self.latest)}")

    def _submit(self, task: Callable[[], None]) -> None:
        with self._starting:  # the writing thread and the training thread both submit
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="checkpoint-upload", daemon=True)
                self._worker.start()
        self._uploads.put(task)

    def _work(self) -> None:
        while True:
            task = self._uploads.get()
            try:
                if self._failure is None:  # after a failure, nothing more: the pointer must not skip a checkpoint
                    task()
            except StoreError as error:
                self._failure = error
            except Exception as error:
                self._failure = StoreError(f"{type(error).__name__}: {error}")
            finally:
                self._uploads.task_done()

    def _store(self, snapshot: Path, file: str, step: int) -> None:
        name = f"{FOLDER}/{stored_name(file, step)}"
        sharded = snapshot.is_dir()
        try:
            size, digest = self._upload_sharded(snapshot, name) if sharded else self._upload_file(snapshot, name)
        finally:
            _remove(snapshot)
        pointer = {"checkpoint": name, "file": file, "step": step, "bytes": size, "sha256": digest}
        self._move_pointer({**pointer, "directory": sharded, **_writer()})
        self.latest = self.store.where(name)
        self._prune(keep_also=name)

    def _store_unless_stored(self, snapshot: Path, file: str) -> None:
        """Store a checkpoint an earlier run of the job wrote, unless the store has all of it; the pointer stays on the
        newest checkpoint."""
        name = f"{FOLDER}/{file}"
        try:
            objects = stored_versions(self.store).get(name, [])
            if snapshot.is_dir():
                if f"{name}/{COMMIT_MARKER}" not in objects:
                    self._upload_sharded(snapshot, name)
            elif name not in objects:
                self._upload_file(snapshot, name)
        finally:
            _remove(snapshot)

    def _upload_file(self, snapshot: Path, name: str) -> tuple[int, str]:
        """Store one file as `name`; its size and hash."""
        digest = sha256_of(snapshot)
        self.store.upload(snapshot, name)
        return snapshot.stat().st_size, digest

    def _upload_sharded(self, snapshot: Path, name: str) -> tuple[int, str]:
        """Store a sharded checkpoint's files as `name/<file>`, its commit marker last; their size, the marker's hash.

        The pointer names the marker's hash: the marker lists every file and its size.
        """
        # A version of this name whose upload a killed job cut short: what is left of it goes first.
        self._delete([found for found in self.store.names(name) if found.startswith(f"{name}/")])
        files = sorted(snapshot.iterdir(), key=lambda file: file.name == COMMIT_MARKER)
        for file in files:
            self.store.upload(file, f"{name}/{file.name}")
        return sum(file.stat().st_size for file in files), sha256_of(snapshot / COMMIT_MARKER)

    def _move_pointer(self, pointer: dict[str, Any]) -> None:
        if not self._pointer_read:
            found = self.store.read(POINTER)
            self._pointer_version = found[1] if found else None
            self._pointer_read = True
        try:
            self._pointer_version = self.store.write(
                POINTER, json.dumps(pointer, indent=1).encode(), replacing=self._pointer_version
            )
        except StoreConflict:
            other = (self.store.read_json(POINTER) or ({}, ""))[0]
            raise StoreError(
                f"{self.store.where(POINTER)} was moved by another job (host {other.get('host')}, process"
                f" {other.get('pid')}): one job per checkpoint location; stop it, or give this run another"
                " checkpoint_store.url"
            ) from None

    def _prune(self, keep_also: str) -> None:
        """Delete the versions beyond the newest `keep` of each file, never the one the pointer names, and what is
        left of sharded ones whose upload was cut short (uploads happen here only, one at a time)."""
        versions = stored_versions(self.store)
        families: dict[str, list[str]] = {}
        for name, objects in versions.items():
            cut_short = name not in objects and f"{name}/{COMMIT_MARKER}" not in objects  # sharded, without its marker
            if cut_short and name != keep_also:
                self._delete(objects)
            else:
                families.setdefault(family(name), []).append(name)
        for names in families.values():
            for name in sorted(names, key=step_of, reverse=True)[self.keep :]:
                if name != keep_also:
                    self._delete(versions[name])

    def _forget(self, file: str) -> None:
        pointed = (self.store.read_json(POINTER) or ({}, ""))[0].get("checkpoint")
        for name, objects in stored_versions(self.store).items():
            if family(name) == family(file) and name != pointed:
                self._delete(objects)

    def _delete(self, objects: list[str]) -> None:
        # A sharded checkpoint's marker first: a deletion cut short leaves a version that is plainly not whole.
        for name in sorted(objects, key=lambda name: not name.endswith(f"/{COMMIT_MARKER}")):
            self.store.delete(name)


def stored_versions(store: ObjectStore) -> dict[str, list[str]]:
    """Each checkpoint version in the store and its objects: a file is one, a sharded checkpoint one per file
    (checkpoints/last-step=36.ckpt: checkpoints/last-step=36.ckpt/__0_0.distcp, ...)."""
    versions: dict[str, list[str]] = {}
    for name in store.names(FOLDER):
        version = "/".join(name.split("/")[:2])
        if version.endswith(".ckpt"):
            versions.setdefault(version, []).append(name)
    return versions


def stored_name(file: str, step: int) -> str:
    """The object's name for a version of a checkpoint file: last.ckpt at step 36 -> last-step=36.ckpt."""
    stem = file.removesuffix(".ckpt")
    return f"{stem}.ckpt" if re.search(r"step=\d+$", stem) else f"{stem}-step={step}.ckpt"


def family(name: str) -> str:
    """What versions of one file share: periodic-step=20.ckpt -> periodic (a best file is a family of its own)."""
    return re.sub(r"-?step=\d+$", "", Path(name).name.removesuffix(".ckpt"))


def step_of(name: str) -> int:
    found = re.search(r"step=(\d+)\.ckpt$", name)
    return int(found.group(1)) if found else -1


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(2**22):
            digest.update(chunk)
    return digest.hexdigest()


def keep_run_id_in_store(store: ObjectStore, checkpoints: Path) -> str:
    """The wandb run id the store keeps wins, so a job on a fresh disk logs to the same run; else ours is kept."""
    id_file = checkpoints / RUN_ID  # written by wandb_run.keep_wandb_run_id
    ours = id_file.read_text().strip()
    found = store.read(RUN_ID)
    if found is None:
        try:
            store.write(RUN_ID, ours.encode(), replacing=None)
            return ours
        except StoreConflict:  # another process of the job was first
            found = store.read(RUN_ID)
    kept = found[0].decode().strip()
    if kept != ours:
        replacement = hidden_name_beside(id_file)
        replacement.write_text(kept)
        os.replace(replacement, id_file)
    return kept


def _snapshot(path: Path) -> Path:
    """A second name for this version of a checkpoint file (of each file of a sharded one): its upload reads that, even
    if the next save replaces `path`, or the sharded strategy removes the directory."""
    snapshot = hidden_name_beside(path, "upload-")
    if path.is_dir():
        snapshot.mkdir()
        for file in path.iterdir():
            os.link(file, snapshot / file.name)
    else:
        os.link(path, snapshot)
    return snapshot


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _writer() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "time": time.strftime("%Y-%m-%d %H:%M:%S %z")}
