"""The run's config made whole before anything is built: output directories, and what cannot run left out."""

import importlib
import os
from pathlib import Path

from jsonargparse import Namespace
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import Checkpoint, DeviceStatsMonitor, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

# Callbacks that write files: the argument naming their directory, and where it goes by default. Any
# ModelCheckpoint (Lightning's, the kit's best checkpoint, a researcher's subclass) writes to checkpoints/.
CHECKPOINTS = ("dirpath", "checkpoints")
OUTPUT_DIRS = {
    ".PreemptionCheckpoint": CHECKPOINTS,
    ".PeriodicCheckpoint": CHECKPOINTS,
    ".PredictionWriter": ("output_dir", ""),
}


# Callbacks that Lightning refuses in a run without a logger.
NEEDS_A_LOGGER = (LearningRateMonitor, DeviceStatsMonitor)
# The kit's callbacks in trainer.callbacks that a fit's guarantees rest on, and what goes without each.
GUARANTEES = {
    "trainkit.checkpoints.last.LastCheckpoint": "no last.ckpt is kept to resume from",
    "trainkit.checkpoints.preemption.PreemptionCheckpoint": "a SIGTERM saves nothing",
    "trainkit.checkpoints.periodic.PeriodicCheckpoint": "a hard kill loses all since the epoch began",
    "trainkit.checkpoints.rng_state.RNGStateCheckpoint": "a resumed run draws other random numbers",
}


def leave_out_what_cannot_run(config: Namespace) -> None:
    """Leave out the callbacks that need what the run turned off, with one line per reason.

    Lightning refuses a learning-rate monitor without a logger and checkpoint callbacks with
    checkpointing off; `--trainer.logger false` or `--trainer.enable_checkpointing false` on the
    default config then means "without those", not a traceback.
    """
    trainer = config.trainer
    if trainer.logger is False or trainer.logger == []:
        left_out = _leave_out(trainer, NEEDS_A_LOGGER)
        if left_out:
            rank_zero_info(f"trainer.logger is off: leaving out {left_out}")
    if trainer.enable_checkpointing is False:
        left_out = _leave_out(trainer, (Checkpoint,))
        resumes = config.get("ckpt_path") == "last"
        if resumes:
            config.ckpt_path = None  # nothing this run writes could be resumed from
        if left_out or resumes:
            not_resuming = "; starting afresh instead of resuming (ckpt_path: last)" if resumes else ""
            rank_zero_info(f"trainer.enable_checkpointing is false: leaving out {left_out or 'nothing'}{not_resuming}")
    if trainer.fast_dev_run and config.get("ckpt_path") == "last":
        # A try of the code: from the run's checkpoint it would train nothing once the run has ended.
        config.ckpt_path = None
        rank_zero_info("trainer.fast_dev_run: starting afresh instead of resuming (ckpt_path: last); it saves nothing")


def say_what_the_callbacks_leave_out(trainer: Namespace) -> None:
    """One line where trainer.callbacks, set by a config that replaced the kit's list, lacks what a fit's guarantees
    rest on (a fit with checkpointing off needs none of it)."""
    if trainer.enable_checkpointing is False or trainer.fast_dev_run:
        return
    given = [class_of(callback.class_path) for callback in configured(trainer.callbacks)]
    missing = {path: why for path, why in GUARANTEES.items() if not any(issubclass(c, class_of(path)) for c in given)}
    if missing:
        names = ", ".join(path.rpartition(".")[2] for path in missing)
        rank_zero_warn(
            f"trainer.callbacks has no {names}: {'; '.join(missing.values())}. A config that sets trainer.callbacks"
            " replaces the kit's list (src/trainkit/defaults.yaml): add a callback with --trainer.callbacks+=<class"
            " path> instead, or copy that list and edit it."
        )


def _leave_out(trainer: Namespace, kinds: tuple[type[Callback], ...]) -> str:
    """Drop the configured callbacks of these kinds; their class names, or "" when there were none."""
    kept, left_out = [], []
    for callback in configured(trainer.callbacks):
        (left_out if issubclass(class_of(callback.class_path), kinds) else kept).append(callback)
    trainer.callbacks = kept
    return ", ".join(dict.fromkeys(callback.class_path.rpartition(".")[2] for callback in left_out))


def names_a_cluster_environment(trainer: Namespace) -> bool:
    """Whether `trainer.plugins` in the config chooses the ClusterEnvironment itself."""
    return any(
        isinstance(plugin, Namespace) and issubclass(class_of(plugin.class_path), ClusterEnvironment)
        for plugin in configured(trainer.plugins)
    )


def put_outputs_under_root_dir(trainer: Namespace) -> None:
    """Point checkpoint callbacks and loggers that name no directory at `trainer.default_root_dir`."""
    root = trainer.default_root_dir or os.getcwd()
    for callback in configured(trainer.callbacks):
        output = _output_dir_argument(callback.class_path)
        if output is not None and callback.init_args.get(output[0]) is None:
            callback.init_args[output[0]] = os.path.join(root, output[1])
    for logger in configured(trainer.logger):
        if logger.init_args.get("save_dir") in (None, "."):
            logger.init_args.save_dir = root


def _output_dir_argument(class_path: str) -> tuple[str, str] | None:
    if issubclass(class_of(class_path), ModelCheckpoint):
        return CHECKPOINTS
    return next((output for suffix, output in OUTPUT_DIRS.items() if class_path.endswith(suffix)), None)


def checkpoint_dir(trainer: Namespace) -> Path:
    for callback in configured(trainer.callbacks):
        if issubclass(class_of(callback.class_path), ModelCheckpoint):
            return Path(callback.init_args.dirpath)
    return Path(trainer.default_root_dir or os.getcwd(), "checkpoints")


def use_sweep_run_dir(trainer: Namespace) -> None:
    """Under `wandb agent` every trial runs the same command: give each its own directory, named by its run id."""
    run_id = os.environ.get("WANDB_RUN_ID")
    if os.environ.get("WANDB_SWEEP_ID") and run_id:
        trainer.default_root_dir = os.path.join(trainer.default_root_dir or os.getcwd(), run_id)


def class_of(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def configured(value) -> list:
    """A config entry that may be missing, a single item or a list, as a list."""
    if value is None or isinstance(value, bool):
        return []
    return list(value) if isinstance(value, list) else [value]
