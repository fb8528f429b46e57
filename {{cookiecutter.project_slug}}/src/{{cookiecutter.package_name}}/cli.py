"""The command line: LightningCLI, plus the cluster environment, node count, run directory and progress output.

Everything a run writes goes under `trainer.default_root_dir`: checkpoints in `checkpoints/`,
the logger's files and `config.yaml`, unless the config names other places.
"""

import logging
import os
import pickle
import sys
import zipfile
from datetime import timedelta
from pathlib import Path

import torch
from jsonargparse import Namespace
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.utilities.exceptions import SIGTERMException

from .checkpointing import PREEMPTED_EXIT_CODE, AtomicCheckpointIO, refusal_reason
from .cluster import ClusterConfigError, ClusterSettings, Platform, detect_platform, platform_of
from .data import MNISTDataModule
from .diagnostics import ExplainDistributedFailure, LogProcessPlacement
from .errors import ConfigError
from .model import MNISTClassifier
from .progress import PlainProgress
from .run_record import SaveRunRecord
from .speed import use_fast_defaults
from .wandb_run import choose_wandb_mode, keep_wandb_run_id

# Callbacks that write files: the argument naming their directory, and where it goes by default.
OUTPUT_DIRS = {
    ".ModelCheckpoint": ("dirpath", "checkpoints"),
    ".PreemptionCheckpoint": ("dirpath", "checkpoints"),
    ".PredictionWriter": ("output_dir", ""),
}
CHECKPOINT_ALIASES = ("last", "best", "hpc")


class ProjectCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_class_arguments(ClusterSettings, "cluster")

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        super().parse_arguments(parser, args)
        # LightningCLI reads the checkpoint right after parsing: check it first.
        subcommand = self.config.get("subcommand")
        if subcommand:
            check_checkpoint_path(self.config[subcommand].get("ckpt_path"))

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand]
        use_sweep_run_dir(config.trainer)
        put_outputs_under_root_dir(config.trainer)
        use_fast_defaults(config.trainer)  # bf16-mixed on GPUs that support it, unless trainer.precision is set
        for logger in _configured(config.trainer.logger):
            if logger.class_path.endswith(".WandbLogger"):
                choose_wandb_mode(logger.init_args.save_dir)
                if self.subcommand == "fit":
                    keep_wandb_run_id(logger, checkpoint_dir(config.trainer))

    def instantiate_trainer(self, **kwargs) -> Trainer:
        config = self.config_init[self.subcommand]
        plugins = list(_configured(config.trainer.plugins))
        chosen = [plugin for plugin in plugins if isinstance(plugin, ClusterEnvironment)]
        platform = platform_of(chosen[0]) if chosen else detect_platform(config.cluster)
        if platform.environment is not None and not chosen:
            plugins.append(platform.environment)
        if not any(isinstance(plugin, CheckpointIO) for plugin in plugins):
            plugins.append(AtomicCheckpointIO())
        use_timeout_for_ddp(config.cluster.timeout)
        callbacks = [
            *_configured(config.trainer.callbacks),
            LogProcessPlacement(platform.name),
            ExplainDistributedFailure(config.cluster.timeout),
        ]
        if config.trainer.enable_progress_bar is None and not sys.stdout.isatty():
            # Output goes to a file (a cluster job): log lines instead of a redrawn bar.
            kwargs["enable_progress_bar"] = False
            callbacks.append(PlainProgress(config.trainer.log_every_n_steps or 50))
        return super().instantiate_trainer(
            plugins=plugins, num_nodes=num_nodes(config.trainer.num_nodes, platform), callbacks=callbacks, **kwargs
        )


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
        ProjectCLI(MNISTClassifier, MNISTDataModule, save_config_callback=SaveRunRecord, args=args)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except SIGTERMException:
        # Lightning ends a process stopped by SIGTERM outside training with status 0: it did not finish.
        sys.exit(PREEMPTED_EXIT_CODE)
