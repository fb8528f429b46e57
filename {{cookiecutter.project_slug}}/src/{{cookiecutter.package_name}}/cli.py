"""The command line: LightningCLI, plus the cluster environment, node count and run directory.

Everything a run writes goes under `trainer.default_root_dir`: checkpoints in `checkpoints/`,
the logger's files and `config.yaml`, unless the config names other places.
"""

import logging
import os
import socket
import sys
from datetime import timedelta
from netrc import NetrcParseError, netrc
from urllib.parse import urlparse

from jsonargparse import Namespace
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.utilities import rank_zero_info

from .cluster import ClusterConfigError, ClusterSettings, Platform, detect_platform, platform_of
from .data import MNISTDataModule
from .model import MNISTClassifier

log = logging.getLogger(__name__)


class LogProcessPlacement(Callback):
    """Each process says once where it sits in the job, to make launch logs easy to check."""

    def __init__(self, platform: str) -> None:
        self.platform = platform

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        environment = getattr(trainer.strategy, "cluster_environment", None)
        main = f"{environment.main_address}:{environment.main_port}" if environment else "none"
        log.info(
            f"[{self.platform}] node_rank={trainer.node_rank} local_rank={trainer.local_rank} "
            f"global_rank={trainer.global_rank} world_size={trainer.world_size} main={main}"
        )


class ProjectCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_class_arguments(ClusterSettings, "cluster")

    def before_instantiate_classes(self) -> None:
        trainer = self.config[self.subcommand].trainer
        put_outputs_under_root_dir(trainer)
        if any(logger.class_path.endswith(".WandbLogger") for logger in _configured(trainer.logger)):
            choose_wandb_mode(trainer.default_root_dir)

    def instantiate_trainer(self, **kwargs) -> Trainer:
        config = self.config_init[self.subcommand]
        plugins = list(_configured(config.trainer.plugins))
        chosen = [plugin for plugin in plugins if isinstance(plugin, ClusterEnvironment)]
        platform = platform_of(chosen[0]) if chosen else detect_platform(config.cluster)
        if platform.environment is not None and not chosen:
            plugins.append(platform.environment)
        use_timeout_for_ddp(config.cluster.timeout)
        return super().instantiate_trainer(
            plugins=plugins,
            num_nodes=num_nodes(config.trainer.num_nodes, platform),
            callbacks=[*_configured(config.trainer.callbacks), LogProcessPlacement(platform.name)],
            **kwargs,
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
        if callback.class_path.endswith(".ModelCheckpoint") and callback.init_args.dirpath is None:
            callback.init_args.dirpath = os.path.join(root, "checkpoints")
    for logger in _configured(trainer.logger):
        if logger.init_args.get("save_dir") in (None, "."):
            logger.init_args.save_dir = root


def choose_wandb_mode(root_dir: str) -> None:
    """Log online when there is an API key and the server answers; otherwise offline. Never fail."""
    if "WANDB_MODE" in os.environ:
        return
    url = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    if not _has_wandb_key(url.hostname):
        reason = "no wandb API key (set WANDB_API_KEY or run `wandb login`)"
    elif not _reachable(url.hostname, url.port or (443 if url.scheme == "https" else 80)):
        reason = f"{url.hostname} cannot be reached"
    else:
        return
    os.environ["WANDB_MODE"] = "offline"
    rank_zero_info(
        f"wandb: {reason}, so this run logs offline to {root_dir}/wandb."
        f" Upload it later with: wandb sync {root_dir}/wandb/offline-run-*"
    )


def _has_wandb_key(host: str | None) -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc(os.environ.get("NETRC")).authenticators(host or "") is not None
    except (FileNotFoundError, NetrcParseError):
        return False


def _reachable(host: str | None, port: int, timeout: float = 3.0) -> bool:
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True
    except OSError:
        return False


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
        ProjectCLI(
            MNISTClassifier,
            MNISTDataModule,
            save_config_kwargs={"overwrite": True},  # a rerun in the same directory resumes, not refuses
            args=args,
        )
    except ClusterConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
