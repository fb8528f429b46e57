"""Sharded training (FSDP2): each process keeps a part of every weight and of the optimizer's state.

Chosen with `--config configs/strategy/fsdp.yaml`. It is Lightning's ModelParallelStrategy with
what a cluster job needs around it:

- Every process shards: the data-parallel size is the number of processes (divided by
  `tensor_parallel_size`, 1 by default), where Lightning's "auto" would take the number of nodes.
- A model that shards nothing is refused in one line: without `fully_shard` in its
  `configure_model` the processes would train apart, each on its own copy, without a word.
- A checkpoint is a directory that counts only once every process's shard is in it
  (checkpoints/sharded_format.py): saved into a hidden directory, marked complete, then renamed into place.
  A process killed during a save leaves the previous checkpoint whole.
- Checkpoints need a directory every node sees (a shared file system): each process writes its
  shard there, and a resume on any number of processes reads all of them.
- `checkpoint_saving.asynchronous`: training waits only for the copy of its shard to memory; the
  write and the commit happen in the background, one save at a time.
"""

import logging
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.tensor import DTensor

from trainkit.checkpoints.disk import checkpoint_dirs
from trainkit.checkpoints.fit import mismatches, refuse_mismatches
from trainkit.checkpoints.io import CheckpointNotWritten, os_error_behind
from trainkit.checkpoints.saving import CheckpointSavingSettings, SaveTimes
from trainkit.checkpoints.sharded_format import META_FILE, commit, sharded_damage
from trainkit.checkpoints.stored import CheckpointNotStored, StoredCheckpointIO
from trainkit.cluster.arrival import wait_for_the_job
from trainkit.cluster.settings import ClusterSettings
from trainkit.run.errors import ConfigError
from trainkit.run.own_failures import job_formed
from trainkit.run.preparing import at_barrier, watch_preparation

log = logging.getLogger(__package__)


class ShardedStrategy(ModelParallelStrategy):
    """ModelParallelStrategy sharding over every process, with checkpoints that count only once whole.

    Args:
        tensor_parallel_size: processes that split each layer's computation (tensor parallelism,
            applied by the model's configure_model over `device_mesh["tensor_parallel"]`); 1 shards
            only the data-parallel way (FSDP2).
        timeout: how long a process waits for the others in a collective; the command line sets it
            from `cluster.timeout`.
        join_timeout: how long the processes wait for each other to form the job; the command line sets
            it from `cluster.join_timeout`.
    """

    def __init__(
        self,
        tensor_parallel_size: int = 1,
        timeout: timedelta = ClusterSettings.timeout,
        join_timeout: timedelta = ClusterSettings.join_timeout,
    ) -> None:
        super().__init__(data_parallel_size="auto", tensor_parallel_size=tensor_parallel_size, timeout=timeout)
        self.join_timeout = join_timeout
        self.saving = CheckpointSavingSettings()
        self._times = SaveTimes()
        self._checkpoint_group: dist.ProcessGroup | None = None
        self._in_flight: tuple[Path, Future, threading.Thread | None] | None = None
        self._failure: str | None = None  # why the save in flight failed, on the first process

    def use(self, cluster: ClusterSettings, saving: CheckpointSavingSettings) -> None:
        """The settings of the command line's `cluster:` and `checkpoint_saving:` sections."""
        self._timeout = cluster.timeout
        self.join_timeout = cluster.join_timeout
        self.saving = saving
        self._times = SaveTimes(saving.grace_seconds)

    def setup_environment(self) -> None:
        processes = self.num_nodes * self.num_processes
        if processes % self._tensor_parallel_size:
            raise ConfigError(
                f"trainer.strategy.init_args.tensor_parallel_size {self._tensor_parallel_size} does not divide the"
                f" job's {processes} processes"
            )
        self._data_parallel_size = processes // self._tensor_parallel_size
        super().setup_environment()
        job_formed(self.node_rank, self.global_rank, self.world_size)
        watch_preparation(self.node_rank, self.global_rank, self.world_size, self._timeout)
        if self.saving.asynchronous:
            # Background saves talk over a group of their own: on the training's group their messages
            # would cross FSDP's. gloo, since torch saves from CPU memory; cluster.timeout, not gloo's 30 minutes.
            self._checkpoint_group = dist.new_group(backend="gloo", timeout=self._timeout)

    def _setup_distributed(self) -> None:
        self._arrival_store = wait_for_the_job(self, self.join_timeout)
        super()._setup_distributed()

    def barrier(self, name: str | None = None) -> None:
        at_barrier(name)  # the first after prepare_data ends the watch (run/preparing.py)
        super().barrier(name)

    def setup(self, trainer: Trainer) -> None:
        module = self.lightning_module
        name = type(module).__name__
        how = "call fully_shard on its blocks over self.device_mesh['data_parallel'] (docs/sharded.md)"
        if not is_overridden("configure_model", module):
            raise ConfigError(f"the sharded strategy needs {name}.configure_model() to shard the model: {how}")
        super().setup(trainer)
        if not any(isinstance(parameter, DTensor) for parameter in module.parameters()):
            raise ConfigError(
                f"{name}.configure_model() sharded no parameter, so each process would train a copy of its own: {how}"
            )
        if trainer.state.fn == TrainerFn.FITTING:
            self._refuse_unshared_checkpoint_dirs(trainer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any = None) -> None:
        started = time.monotonic()  # training waits from here, for the save before this one too
        self.wait_for_checkpoints()  # one save at a time; a failed one ends the job here
        self._raise_if_not_stored()
        path = Path(self.broadcast(str(filepath)))
        partial = path.with_name(f".{path.name}.partial-{self.broadcast(uuid.uuid4().hex[:8])}")
        shards = {"state_dict": checkpoint.pop("state_dict")}
        shards.update({f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))})
        step = int(checkpoint.get("global_step", 0))
        failure = None
        if self.global_rank == 0:
            _remove_unfinished_saves(path)
            failure = _attempt(lambda: _save_meta(checkpoint, partial))
        self._raise_if_any(path, failure)  # every process ends alike
        if not self.saving.asynchronous:
            self._raise_if_any(path, _attempt(lambda: dcp.save(shards, checkpoint_id=partial)))
            if self.global_rank == 0:
                failure = _attempt(lambda: _commit_and_swap(partial, path, step, self.world_size))
                if failure is None:
                    seconds = time.monotonic() - started
                    self._times.report(path, seconds, seconds)
                    self.checkpoint_io.written(path, step)  # a checkpoint store uploads it (checkpoints/stored.py)
            self._raise_if_any(path, failure)
            return
        future = dcp.async_save(shards, checkpoint_id=partial, process_group=self._checkpoint_group)
        returned = time.monotonic()
        committer = None
        if self.global_rank == 0:  # its save ends after every process's shard is written
            committer = threading.Thread(
                target=self._commit_when_written, args=(future, partial, path, step, returned - started), daemon=True
            )
            committer.start()
        self._in_flight = (path, future, committer)

    def wait_for_checkpoints(self) -> None:
        """Return once the background save (if any) is written and committed; raise CheckpointNotWritten if not."""
        if self._in_flight is None:
            return
        path, future, committer = self._in_flight
        self._in_flight = None
        reason = _attempt(future.result)
        if committer is not None:
            committer.join()
            reason = reason or self._failure
            self._failure = None
        self._raise_if_any(path, reason)

    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(checkpoint_path)
        if path.is_dir():
            problem = sharded_damage(path)
            if problem:
                raise ConfigError(f"ckpt_path {path} is damaged: {problem}")
            # torch would fail on every process with a traceback: say which tensors differ, once.
            saved = FileSystemReader(path).read_metadata().state_dict_metadata
            shapes = {
                key.removeprefix("state_dict."): torch.empty(meta.size, device="meta")
                for key, meta in saved.items()
                if key.startswith("state_dict.") and hasattr(meta, "size")
            }
            refuse_mismatches(path, mismatches(self.lightning_module.state_dict(), shapes, strict=False))
        return super().load_checkpoint(path, weights_only)

    def teardown(self) -> None:
        try:
            self.wait_for_checkpoints()
        except CheckpointNotWritten as error:
            if sys.exc_info()[0] is None:
                raise
            log.error(f"error: {error}")  # the run is already ending with another error: say this one too
        finally:
            super().teardown()

    def _commit_when_written(self, future: Future, partial: Path, path: Path, step: int, blocked: float) -> None:
        returned = time.monotonic()
        if future.exception() is not None:
            return  # wait_for_checkpoints reports it
        try:
            self._failure = _attempt(lambda: _commit_and_swap(partial, path, step, self.world_size))
        except Exception as error:  # not the disk: a bug, reported when the job waits for this save
            self._failure = f"{type(error).__name__}: {error}"
        if self._failure is None:
            self._times.report(path, blocked, time.monotonic() - returned)  # the write, after the copy
            self.checkpoint_io.written(path, step)

    def _raise_if_any(self, path: Path, reason: str | None) -> None:
        """Raise CheckpointNotWritten on every process if any process failed (`reason` is its own failure)."""
        if self._on_any_process(reason is not None):
            raise CheckpointNotWritten(path, reason or "another process could not write its shard")

    def _raise_if_not_stored(self) -> None:
        """An upload to the checkpoint store failed (the first process uploads): every process ends here alike."""
        failure = None
        if self.global_rank == 0 and isinstance(self.checkpoint_io, StoredCheckpointIO):
            try:
                self.checkpoint_io.raise_failure()
            except CheckpointNotStored as error:
                failure = error
        if self._on_any_process(failure is not None):
            raise failure or CheckpointNotStored("the first process could not store a checkpoint", None)

    def _on_any_process(self, flag: bool) -> bool:
        """Whether `flag` is true on any process of the job (every process calls this at the same point)."""
        found = torch.tensor([flag], dtype=torch.int32, device=self.root_device)
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return bool(found.item())

    def _refuse_unshared_checkpoint_dirs(self, trainer: Trainer) -> None:
        """Every process must see the directory the first one writes to: resuming reads every shard."""
        token = self.broadcast(uuid.uuid4().hex[:8])
        directories = sorted({directory.resolve() for directory in checkpoint_dirs(trainer)})  # each one once
        probes = [directory / f".shared-{token}" for directory in directories]
        if self.global_rank == 0:
            for probe in probes:
                probe.parent.mkdir(parents=True, exist_ok=True)
                probe.touch()
        self.barrier("shared checkpoint directory")
        unseen = [probe.parent for probe in probes if not probe.exists()]
        self.barrier("shared checkpoint directory seen")
        if self.global_rank == 0:
            for probe in probes:
                probe.unlink()
        if self._on_any_process(bool(unseen)):
            raise ConfigError(
                f"sharded checkpoints need a directory every node sees, and {directories[0]} is not the same directory"
                " on every node: put trainer.default_root_dir on a file system all nodes mount"
            )


def _save_meta(checkpoint: dict[str, Any], partial: Path) -> None:
    partial.mkdir(parents=True)
    torch.save(checkpoint, partial / META_FILE)


def _commit_and_swap(partial: Path, path: Path, step: int, world_size: int) -> None:
    """Mark the saved directory complete and put it in place of the older checkpoint of that name."""
    commit(partial, step, world_size)
    older = path.with_name(partial.name.replace(".partial-", ".old-"))
    if path.exists():
        path.rename(older)
    try:
        partial.rename(path)
    except FileNotFoundError:
        # Between the two renames, a process looking for a checkpoint (checkpoints/resume.py) finishes the swap itself.
        if not path.exists():
            raise
    if older.is_dir():
        shutil.rmtree(older)
    else:
        older.unlink(missing_ok=True)  # a one-file checkpoint of a non-sharded run


def _remove_unfinished_saves(path: Path) -> None:
    """Hidden directories of earlier saves of this name, left by a process killed during a save."""
    for left in [*path.parent.glob(f".{path.name}.partial-*"), *path.parent.glob(f".{path.name}.old-*")]:
        shutil.rmtree(left, ignore_errors=True)


def _attempt(save: Callable[[], Any]) -> str | None:
    """Run `save`; None when it worked, else the file system's reason. Anything but a file system error is raised."""
    try:
        save()
    except Exception as error:
        refusal = os_error_behind(error)
        if refusal is None:
            raise
        return refusal.strerror or str(refusal)
    return None
