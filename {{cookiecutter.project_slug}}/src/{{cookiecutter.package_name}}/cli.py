"""The command line: LightningCLI, plus the cluster environment, node count, run directory and progress output.

Everything a run writes goes under `trainer.default_root_dir`: checkpoints in `checkpoints/`,
the logger's files and `config.yaml`, unless the config names other places.
"""

import importlib
import logging
import os
import pickle
import sys
import traceback
import zipfile
from datetime import timedelta
from pathlib import Path

import torch
from jsonargparse import ArgumentError, Namespace
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch import Callback, LightningDataModule, Trainer
from lightning.pytorch.callbacks import Checkpoint, DeviceStatsMonitor, LearningRateMonitor
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

from .checkpoint_fit import RefuseCheckpointsThatDoNotFit
from .checkpointing import AtomicCheckpointIO, refusal_reason
from .cluster import (
    ClusterConfigError,
    ClusterSettings,
    NodeLevelEnvironment,
    Platform,
    detect_platform,
    platform_of,
)
from .config_errors import OneLineErrorParser, one_line
from .diagnostics import ExplainDistributedFailure, LogProcessPlacement, lost_contact
from .errors import ConfigError
from .exit_codes import CONFIG_ERROR, LOST_NODE, PREEMPTED
from .model import MNISTClassifier
from .progress import PlainProgress
from .roll_call import NodesDidNotArrive
from .run_record import SaveRunRecord
from .speed import use_fast_defaults
from .stopping import stop_with_this_process
from .wandb_run import choose_wandb_mode, keep_wandb_run_id

# Callbacks that write files: the argument naming their directory, and where it goes by default.
OUTPUT_DIRS = {
    ".ModelCheckpoint": ("dirpath", "checkpoints"),
    ".PreemptionCheckpoint": ("dirpath", "checkpoints"),
    ".PredictionWriter": ("output_dir", ""),
}
CHECKPOINT_ALIASES = ("last", "best", "hpc")
# Callbacks that Lightning refuses in a run without a logger.
NEEDS_A_LOGGER = (LearningRateMonitor, DeviceStatsMonitor)


class ProjectCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_class_arguments(ClusterSettings, "cluster")

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        if subcommand:
            config = self.config[subcommand]
            # LightningCLI reads the checkpoint right after parsing: check it first.
            check_checkpoint_path(config.get("ckpt_path"))
            # Before anything logs (the seed is set next): which platform, and this process's rank on it.
            self.platform = None if names_a_cluster_environment(config.trainer) else detect_platform(config.cluster)
            if self.platform is not None and isinstance(self.platform.environment, NodeLevelEnvironment):
                self.platform.environment.use_rank_before_launch()

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand]
        leave_out_what_cannot_run(config)
        use_sweep_run_dir(config.trainer)
        put_outputs_under_root_dir(config.trainer)
        use_fast_defaults(config.trainer)  # bf16-mixed on GPUs that support it, unless trainer.precision is set
        for logger in _configured(config.trainer.logger):
            if logger.class_path.endswith(".WandbLogger"):
                choose_wandb_mode(logger.init_args.save_dir)
                if self.subcommand == "fit" and config.trainer.enable_checkpointing is not False:
                    keep_wandb_run_id(logger, checkpoint_dir(config.trainer))

    def instantiate_trainer(self, **kwargs) -> Trainer:
        config = self.config_init[self.subcommand]
        plugins = list(_configured(config.trainer.plugins))
        chosen = [plugin for plugin in plugins if isinstance(plugin, ClusterEnvironment)]
        platform = platform_of(chosen[0]) if chosen else self.platform
        if platform.environment is not None and not chosen:
            plugins.append(platform.environment)
        if not any(isinstance(plugin, CheckpointIO) for plugin in plugins):
            plugins.append(AtomicCheckpointIO())
        use_timeout_for_ddp(config.cluster.timeout)
        callbacks = [
            *_configured(config.trainer.callbacks),
            LogProcessPlacement(platform.name),
            ExplainDistributedFailure(config.cluster.timeout),
            RefuseCheckpointsThatDoNotFit(),
        ]
        if config.trainer.enable_progress_bar is None and not sys.stdout.isatty():
            # Output goes to a file (a cluster job): log lines instead of a redrawn bar.
            kwargs["enable_progress_bar"] = False
            callbacks.append(PlainProgress(config.trainer.log_every_n_steps or 50))
        trainer = super().instantiate_trainer(
            plugins=plugins,
            num_nodes=num_nodes(config.trainer.num_nodes, platform),
            devices=devices_per_node(config.trainer.devices, platform),
            callbacks=callbacks,
            **kwargs,
        )
        # The processes Lightning starts on this node stop with this one, whatever it is doing (stopping.py).
        stop_with_this_process(lambda: getattr(trainer.strategy.launcher, "procs", []))
        return trainer


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


def _leave_out(trainer: Namespace, kinds: tuple[type[Callback], ...]) -> str:
    """Drop the configured callbacks of these kinds; their class names, or "" when there were none."""
    kept, left_out = [], []
    for callback in _configured(trainer.callbacks):
        (left_out if issubclass(_class_of(callback.class_path), kinds) else kept).append(callback)
    trainer.callbacks = kept
    return ", ".join(dict.fromkeys(callback.class_path.rpartition(".")[2] for callback in left_out))


def names_a_cluster_environment(trainer: Namespace) -> bool:
    """Whether `trainer.plugins` in the config chooses the ClusterEnvironment itself."""
    return any(
        isinstance(plugin, Namespace) and issubclass(_class_of(plugin.class_path), ClusterEnvironment)
        for plugin in _configured(trainer.plugins)
    )


def devices_per_node(configured: int | str | list[int], platform: Platform) -> int | str | list[int]:
    """The processes the launcher started on this node when `trainer.devices` is auto; a different count is an error."""
    started = platform.processes_per_node
    if started is None:
        return configured
    if configured == "auto":
        return started
    requested = _device_count(configured)
    if requested is not None and requested != started:
        raise ClusterConfigError(
            f"trainer.devices={configured} but {platform.processes_per_node_variable}={started}: {platform.name}"
            f" started {started} processes on this node; leave trainer.devices at auto, the launcher sets it"
        )
    return configured


def _device_count(devices: int | str | list[int]) -> int | None:
    """How many devices `trainer.devices` asks for, when it says so plainly (a count or a list of indices)."""
    if isinstance(devices, list):
        return len(devices)
    text = str(devices).strip()
    return int(text) if text.isdigit() else None


def num_nodes(configured: int, platform: Platform) -> int:
    """The platform's node count; a different `trainer.num_nodes` (other than the default 1) is an error."""
    if platform.num_nodes is None:
        return configured
    if configured not in (1, platform.num_nodes):
        raise ClusterConfigError(
            f"trainer.num_nodes={configured} but {platform.num_nodes_variable}={platform.num_nodes} on"
            f" {platform.name}; leave trainer.num_nodes out, the platform sets it"
        )
    return platform.num_nodes


def use_timeout_for_ddp(timeout: timedelta) -> None:
    # With several processes, strategy "auto" resolves to Lightning's registered "ddp" strategy;
    # registering it with our timeout makes a lost or missing process fail the job in minutes.
    StrategyRegistry.register(
        "ddp", DDPStrategy, description="DDP with cluster.timeout", override=True, start_method="popen", timeout=timeout
    )


def put_outputs_under_root_dir(trainer: Namespace) -> None:
    """Point checkpoint callbacks and loggers that name no directory at `trainer.default_root_dir`."""
    root = trainer.default_root_dir or os.getcwd()
    for callback in _configured(trainer.callbacks):
        for suffix, (argument, subdir) in OUTPUT_DIRS.items():
            if callback.class_path.endswith(suffix) and callback.init_args.get(argument) is None:
                callback.init_args[argument] = os.path.join(root, subdir)
    for logger in _configured(trainer.logger):
        if logger.init_args.get("save_dir") in (None, "."):
            logger.init_args.save_dir = root


def checkpoint_dir(trainer: Namespace) -> Path:
    for callback in _configured(trainer.callbacks):
        if callback.class_path.endswith(".ModelCheckpoint"):
            return Path(callback.init_args.dirpath)
    return Path(trainer.default_root_dir or os.getcwd(), "checkpoints")


def use_sweep_run_dir(trainer: Namespace) -> None:
    """Under `wandb agent` every trial runs the same command: give each its own directory, named by its run id."""
    run_id = os.environ.get("WANDB_RUN_ID")
    if os.environ.get("WANDB_SWEEP_ID") and run_id:
        trainer.default_root_dir = os.path.join(trainer.default_root_dir or os.getcwd(), run_id)


def check_checkpoint_path(ckpt_path: str | None) -> None:
    """Refuse a checkpoint path that is missing or not a checkpoint before anything is written."""
    if ckpt_path is None or ckpt_path in CHECKPOINT_ALIASES or "://" in ckpt_path:
        return
    if not Path(ckpt_path).is_file():
        raise ConfigError(f"ckpt_path {ckpt_path} does not exist")
    if not zipfile.is_zipfile(ckpt_path):
        raise ConfigError(f"ckpt_path {ckpt_path} is not a checkpoint (torch.save writes zip archives)")
    try:  # memory-mapped: only the pickled structure is read, not the tensors
        torch.load(ckpt_path, weights_only=True, mmap=True, map_location="cpu")
    except pickle.UnpicklingError as error:
        raise ConfigError(f"refused to load ckpt_path {ckpt_path}: {refusal_reason(error)}") from None


def _class_of(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _configured(value) -> list:
    """A config entry that may be missing, a single item or a list, as a list."""
    if value is None or isinstance(value, bool):
        return []
    return list(value) if isinstance(value, list) else [value]


def _show_info_logs() -> None:
    logger = logging.getLogger(__package__)
    logger.setLevel(logging.INFO)
    if not logger.handlers:
        logger.addHandler(logging.StreamHandler())


def main(args: list[str] | None = None) -> None:
    _show_info_logs()
    try:
        # The data module is chosen in the config (`data: class_path: ...`): in memory or streamed.
        ProjectCLI(
            MNISTClassifier,
            LightningDataModule,
            subclass_mode_data=True,
            save_config_callback=SaveRunRecord,
            parser_class=OneLineErrorParser,  # bad settings raise ArgumentError: one line, usage only on --help
            args=args,
        )
    except (ArgumentError, ConfigError) as error:
        # Under torchrun and Slurm every process of a node finds the same error: the first one says it.
        if os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")) == "0":
            print(f"error: {one_line(error)}", file=sys.stderr)
        sys.exit(CONFIG_ERROR)
    except NodesDidNotArrive as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(LOST_NODE)
    except Exception as error:
        if not lost_contact(error):
            raise
        traceback.print_exception(error)  # ends with the line naming the lost node
        sys.exit(LOST_NODE)
    except SIGTERMException:
        # Lightning ends a process stopped by SIGTERM outside training with status 0: it did not finish.
        sys.exit(PREEMPTED)
