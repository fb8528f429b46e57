"""`ckpt_path` checked before LightningCLI loads it: missing files and files that are not checkpoints refused.

A fit whose `ckpt_path` names another run's checkpoint (or a pretrained model's) starts from it once: a
restarted job goes on from the run's own newest checkpoint. `ckpt_path: best` is found in the checkpoint
directory, so that `test`, `validate` and `predict` in a new process use the best checkpoint of an earlier
`fit`. A checkpoint is a file, or a directory saved by the sharded strategy (checkpoints/sharded_format.py),
which only that strategy loads.
"""

import ast
import pickle
import zipfile
from pathlib import Path

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint

from trainkit.checkpoints.disk import checkpoint_dirs
from trainkit.checkpoints.io import refusal_reason
from trainkit.checkpoints.resume import damage, download_checkpoint, newer_from_store, newest_whole_checkpoint
from trainkit.checkpoints.sharded_format import DCP_METADATA, checkpoint_meta, is_sharded
from trainkit.checkpoints.stored import FOLDER
from trainkit.run.errors import ConfigError
from trainkit.store.object_store import ObjectStore

CHECKPOINT_ALIASES = ("last", "best", "hpc")


def check_checkpoint_path(ckpt_path: str | None, weights_only: bool | None) -> None:
    """Refuse a checkpoint path that is missing or not a checkpoint before anything is written.

    Loading a checkpoint that holds code (`--weights_only false`) takes a file named on purpose:
    never one the job finds by itself, which anyone who can write to its directory could have put there.
    """
    if weights_only is False and ckpt_path in CHECKPOINT_ALIASES:
        raise ConfigError(
            f"weights_only false runs code from the checkpoint: it needs ckpt_path to name the file, not {ckpt_path}"
        )
    if ckpt_path is None or ckpt_path in CHECKPOINT_ALIASES or "://" in ckpt_path:
        return
    if not Path(ckpt_path).exists():
        raise ConfigError(f"ckpt_path {ckpt_path} does not exist")
    if is_sharded(ckpt_path) and not Path(ckpt_path, DCP_METADATA).exists():
        raise ConfigError(f"ckpt_path {ckpt_path} is a directory, not a checkpoint")
    if not is_sharded(ckpt_path) and not zipfile.is_zipfile(ckpt_path):
        raise ConfigError(f"ckpt_path {ckpt_path} is not a checkpoint (torch.save writes zip archives)")
    try:
        problem = damage(Path(ckpt_path))
    except pickle.UnpicklingError as error:
        if weights_only is not False:
            raise ConfigError(f"refused to load ckpt_path {ckpt_path}: {refusal_reason(error)}") from None
    else:
        if problem is not None:
            raise ConfigError(f"ckpt_path {ckpt_path} is damaged: {problem}")


def find_best_checkpoint(callback: Checkpoint | None, store: ObjectStore | None = None) -> None:
    """Tell the first ModelCheckpoint which file is its best, from the checkpoints of earlier runs.

    Lightning resolves `ckpt_path: best` from what that callback remembers of a `fit` in this
    process, and fails in any other. Every checkpoint holds the callback's state, which names the
    best file: the newest checkpoint in its directory (last.ckpt after every epoch) says which.
    With a checkpoint store, files missing on this disk are downloaded from it.
    """
    if not isinstance(callback, ModelCheckpoint) or callback.dirpath is None:
        raise ConfigError("ckpt_path best needs a ModelCheckpoint in trainer.callbacks; pass a checkpoint file instead")
    if callback.best_model_path:
        return
    directory = Path(callback.dirpath)
    newest = newest_whole_checkpoint([directory])
    if newest is None and store is not None:  # a fresh disk: the store's newest names the best
        newest = newer_from_store(store, directory, local_step=-1)
    if newest is None:
        raise ConfigError(f"ckpt_path best: no checkpoints in {directory}; run fit first or pass a checkpoint file")
    states = checkpoint_meta(newest).get("callbacks", {})
    best = states.get(callback.state_key, {}).get("best_model_path")
    if not best:
        raise ConfigError(f"ckpt_path best: {newest} records no best checkpoint {_kept_by(callback, states)}")
    # A run directory copied or moved since keeps the file names: look for the same name here.
    best = Path(best) if Path(best).exists() else directory / Path(best).name
    if not best.exists() and store is not None:
        download_checkpoint(store, f"{FOLDER}/{best.name}", best)
    if not best.exists():
        raise ConfigError(f"ckpt_path best: {newest} names {best.name} as the best checkpoint, not in {directory}")
    callback.best_model_path = str(best)


def _kept_by(callback: ModelCheckpoint, states: dict) -> str:
    """Which metric the best checkpoint asked for is kept by, and which the checkpoint's run kept one by."""
    asked = f"by {callback.monitor} ({callback.mode})" if callback.monitor else f"of {callback.state_key}"
    recorded = [settings for key, state in states.items() if (settings := _monitor_and_mode(key, state))]
    if not recorded:
        return f"{asked}; pass a checkpoint file"
    monitor, mode = recorded[0]
    return (
        f"{asked}, only by {monitor} ({mode}): give --best_checkpoint.monitor {monitor} --best_checkpoint.mode {mode}"
        f" as the run did, or pass a checkpoint file"
    )


def _monitor_and_mode(state_key: str, state: object) -> tuple[str, str] | None:
    """A ModelCheckpoint's metric and mode, from its state's key: its class and settings as Lightning wrote them."""
    if not isinstance(state, dict) or not state.get("best_model_path") or "{" not in state_key:
        return None
    try:
        settings = ast.literal_eval(state_key[state_key.index("{") :])
    except (ValueError, SyntaxError):  # a setting with no literal form (a timedelta)
        return None
    return (settings["monitor"], settings["mode"]) if settings.get("monitor") and settings.get("mode") else None


def refuse_sharded_without_strategy(path: Path | None, sharded_strategy: bool) -> None:
    """Only the sharded strategy loads a sharded checkpoint: other runs would fail in torch.load with a traceback."""
    if path is None or sharded_strategy or not is_sharded(path):
        return
    raise ConfigError(
        f"ckpt_path {path} is a sharded checkpoint (a directory written by the sharded strategy): add --config"
        f" configs/strategy/fsdp.yaml, or convert it to one file with python -m trainkit.checkpoints.sharded_format"
        f" {path} OUT.ckpt"
    )


def started_elsewhere(ckpt_path: str | None, trainer: Trainer) -> bool:
    """Whether `ckpt_path` names a checkpoint outside the run's own checkpoint directories (another run's, a
    pretrained model's): where a fit starts, not where a restarted job goes on."""
    if ckpt_path in (None, *CHECKPOINT_ALIASES):
        return False
    return "://" in ckpt_path or Path(ckpt_path).resolve().parent not in checkpoint_dirs(trainer)
