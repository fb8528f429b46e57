"""The command line: LightningCLI, plus the cluster environment, node count, run directory and progress output.

The model and the data module are chosen in the config (`model: class_path: ...`, `data: ...`),
so this module never imports the researcher's code. Everything a run writes goes under
`trainer.default_root_dir`: checkpoints in `checkpoints/`, the logger's files and `config.yaml`.
"""

import logging
import os
import sys
import time
import traceback
from pathlib import Path

import torch.distributed as dist
from jsonargparse import ArgumentError, Namespace
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException

from trainkit.checkpoints.best import BestCheckpointSettings, add_best_checkpoint
from trainkit.checkpoints.disk import CheckCheckpointDisk, refuse_unwritable_checkpoint_dirs
from trainkit.checkpoints.epoch_end import ResumeFinishedEpochs
from trainkit.checkpoints.fit import RefuseCheckpointsThatDoNotFit
from trainkit.checkpoints.io import AtomicCheckpointIO, CheckpointNotWritten
from trainkit.checkpoints.path import (
    CHECKPOINT_ALIASES,
    check_checkpoint_path,
    find_best_checkpoint,
    refuse_sharded_without_strategy,
    started_elsewhere,
)
from trainkit.checkpoints.resume import own_checkpoint, quiet_about_a_directory_without_checkpoints, resume_checkpoint
from trainkit.checkpoints.saving import CheckpointSavingSettings
from trainkit.checkpoints.stored import (
    CheckpointNotStored,
    CheckpointStoreSettings,
    StoredCheckpointIO,
    keep_run_id_in_store,
)
from trainkit.checkpoints.tuners import ResumeWhatTunersFound
from trainkit.cluster.node_level import NodeLevelEnvironment
from trainkit.cluster.platforms import detect_platform, platform_of
from trainkit.cluster.process_counts import devices_per_node, num_nodes
from trainkit.cluster.roll_call import NodesDidNotArrive
from trainkit.cluster.settings import ClusterSettings
from trainkit.data.loader_states import LoaderStatePerProcess
from trainkit.data.resumable import ResumableData
from trainkit.run import stopping
from trainkit.run.config import (
    checkpoint_dir,
    configured,
    leave_out_what_cannot_run,
    names_a_cluster_environment,
    put_outputs_under_root_dir,
    say_what_the_callbacks_leave_out,
    use_sweep_run_dir,
)
from trainkit.run.config_errors import OneLineErrorParser, mistake_in_the_researchers_code, one_line
from trainkit.run.data_to_model import check_what_the_model_got, pass_data_to_model
from trainkit.run.diagnostics import ExplainDistributedFailure, LogProcessPlacement, lost_contact
from trainkit.run.errors import ConfigError
from trainkit.run.exit_codes import CANNOT_WRITE, CONFIG_ERROR, INTERRUPTED, LOST_NODE, PREEMPTED
from trainkit.run.lock import lock_run_dir
from trainkit.run.machine import CheckThisMachine
from trainkit.run.node_watch import status_after, watch_started_processes
from trainkit.run.own_failures import tell_the_others
from trainkit.run.quiet import quiet_library_noise
from trainkit.run.replaced_classes import replace_whole
from trainkit.run.speed import use_fast_defaults
from trainkit.run.stopping import stop_with_this_process
from trainkit.run.validation_interval import RefuseAValidationIntervalLongerThanTheEpoch
from trainkit.store.lock import lock_store
from trainkit.store.object_store import ObjectStore, StoreError, open_store
from trainkit.strategies.sharded import ShardedStrategy
from trainkit.strategies.timeouts import use_timeouts_for_ddp, watch_ddp_configured_by_class
from trainkit.tracking.progress import PlainProgress
from trainkit.tracking.record import SaveRunRecord, keep_hyperparameters_apart
from trainkit.tracking.wandb_logger import choose_wandb_mode, keep_wandb_run_id

# The kit's callbacks, logger and settings, loaded before the project's configs (which override them).
DEFAULTS = Path(__file__).with_name("defaults.yaml")
SUBCOMMANDS = ("fit", "validate", "test", "predict")


class ProjectCLI(LightningCLI):
    def __init__(self, *args, parser_kwargs: dict | None = None, run: bool = True, **kwargs) -> None:
        defaults = {"default_config_files": [str(DEFAULTS)]}
        if run:  # the subcommands' parsers read the configs
            defaults = {subcommand: defaults for subcommand in SUBCOMMANDS}
        super().__init__(*args, parser_kwargs={**defaults, **(parser_kwargs or {})}, run=run, **kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_class_arguments(BestCheckpointSettings, "best_checkpoint")
        parser.add_class_arguments(ClusterSettings, "cluster")
        parser.add_class_arguments(CheckpointStoreSettings, "checkpoint_store")
        parser.add_class_arguments(CheckpointSavingSettings, "checkpoint_saving")
        pass_data_to_model(parser)  # what the data module knows about its samples is not repeated for the model

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        if isinstance(args, (dict, Namespace)):
            super().parse_arguments(parser, args)
        else:  # a model or data module of another class replaces the one set before it whole
            self.config = parser.parse_args(replace_whole(sys.argv[1:] if args is None else list(args)))
        subcommand = self.config.get("subcommand")
        if subcommand:
            config = self.config[subcommand]
            # LightningCLI reads the checkpoint right after parsing: check it first.
            check_checkpoint_path(config.get("ckpt_path"), config.get("weights_only"))
            # Before anything logs (the seed is set next): which platform, and this process's rank on it.
            if names_a_cluster_environment(config.trainer):
                self.platform = None
            else:
                self.platform = detect_platform(config.cluster, config.trainer.num_nodes)
            if self.platform is not None and isinstance(self.platform.environment, NodeLevelEnvironment):
                self.platform.environment.use_rank_before_launch()

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand]
        add_best_checkpoint(config)
        leave_out_what_cannot_run(config)
        use_sweep_run_dir(config.trainer)
        # What config.yaml keeps: not the directories and the wandb run id filled in below from this run's
        # directory, or `--config runs/x/config.yaml` in another directory would write to, and resume, run x.
        self.as_configured = config.clone()
        watch_ddp_configured_by_class(config.trainer.strategy, config.cluster)
        if self.subcommand == "fit":  # one job per run directory; test, validate and predict may run beside it
            lock_run_dir(config.trainer.default_root_dir or os.getcwd())
        put_outputs_under_root_dir(config.trainer)
        if self.subcommand == "fit":
            refuse_unwritable_checkpoint_dirs(config.trainer)  # before training finds out at its first save
            say_what_the_callbacks_leave_out(config.trainer)
        use_fast_defaults(config.trainer)  # bf16-mixed on GPUs that support it, unless trainer.precision is set
        self.store = checked_store(config.checkpoint_store, writable=self.subcommand == "fit")
        if self.store is not None and self.subcommand == "fit":  # one job per store location, as per run directory
            lock_store(self.store)
        for logger in configured(config.trainer.logger):
            if logger.class_path.endswith(".WandbLogger"):
                choose_wandb_mode(logger.init_args.save_dir)
                if self.subcommand == "fit" and config.trainer.enable_checkpointing is not False:
                    keep_wandb_run_id(logger, checkpoint_dir(config.trainer))
                    if self.store is not None:  # a job on a fresh disk logs to the same wandb run
                        logger.init_args.id = keep_run_id_in_store(self.store, checkpoint_dir(config.trainer))

    def instantiate_classes(self) -> None:
        super().instantiate_classes()
        if self.datamodule is not None:
            check_what_the_model_got(self.model, self.datamodule, self._get(self.config, "model"))
            keep_hyperparameters_apart(self.model, self.datamodule)

    def instantiate_trainer(self, **kwargs) -> Trainer:
        config = self.config_init[self.subcommand]
        plugins = list(configured(config.trainer.plugins))
        chosen = [plugin for plugin in plugins if isinstance(plugin, ClusterEnvironment)]
        platform = platform_of(chosen[0]) if chosen else self.platform
        if platform.environment is not None and not chosen:
            plugins.append(platform.environment)
        if not any(isinstance(plugin, CheckpointIO) for plugin in plugins):
            saving = config.checkpoint_saving
            keep = config.checkpoint_store.keep
            io = AtomicCheckpointIO(saving) if self.store is None else StoredCheckpointIO(self.store, keep, saving)
            plugins.append(io)
        use_timeouts_for_ddp(config.cluster)
        watch_started_processes(config.cluster.timeout)  # a lost peer ends the node with 75, not Lightning's SIGKILL
        if isinstance(config.trainer.strategy, ShardedStrategy):
            config.trainer.strategy.use(config.cluster, config.checkpoint_saving)
        callbacks = [
            *configured(config.trainer.callbacks),
            LogProcessPlacement(platform.name),
            ExplainDistributedFailure(config.cluster.timeout),
            RefuseCheckpointsThatDoNotFit(),
            ResumeFinishedEpochs(),  # Lightning resumes a checkpoint from just after an epoch's last batch wrongly
            ResumeWhatTunersFound(),  # Lightning's tuners would start a resumed fit's counts over
            CheckCheckpointDisk(),  # room for a checkpoint before training; a failed write ends the job
            CheckThisMachine(),  # a compiler for a compiled model, /dev/shm enough (run/machine.py)
            ResumableData(),  # ordinary DataLoaders resume exactly, mid-epoch too (data/resumable.py)
            LoaderStatePerProcess(),  # a stateful loader of the project's own resumes each process's state
            RefuseAValidationIntervalLongerThanTheEpoch(),  # of a stream, where Lightning cannot tell at the start
        ]
        own_bar = any(isinstance(callback, ProgressBar) for callback in configured(config.trainer.callbacks))
        if config.trainer.enable_progress_bar is None and not sys.stdout.isatty() and not own_bar:
            # Output goes to a file (a cluster job): log lines instead of a redrawn bar, unless one is configured.
            kwargs["enable_progress_bar"] = False
            callbacks.append(PlainProgress(config.trainer.log_every_n_steps or 50))
        try:
            trainer = super().instantiate_trainer(
                plugins=plugins,
                num_nodes=num_nodes(config.trainer.num_nodes, platform),
                devices=devices_per_node(config.trainer.devices, platform),
                callbacks=callbacks,
                **kwargs,
            )
        except MisconfigurationException as error:  # a setting the Trainer refuses (`max_epochs: -5`): a config error
            raise ConfigError(f"trainer: {error}") from None  # said on one line, as every ConfigError
        for callback in trainer.callbacks:
            if isinstance(callback, SaveRunRecord):
                callback.config = self.as_configured
        if isinstance(platform.environment, NodeLevelEnvironment):
            platform.environment.call_the_roll(trainer.num_devices)  # every node here, each with as many devices
        chosen = config.get("ckpt_path")
        quiet_about_a_directory_without_checkpoints(trainer)
        if chosen == "last":
            # The newest checkpoint that is whole, not only the newest (checkpoints/resume.py).
            found = resume_checkpoint(trainer)
            if found is not None:
                self.config_init[self.subcommand]["ckpt_path"] = str(found)
        elif self.subcommand == "fit" and started_elsewhere(chosen, trainer):
            # Started from another run's checkpoint: a restarted job, running the same command, goes on from its own.
            own = own_checkpoint(trainer)
            if own is not None:
                rank_zero_info(
                    f"resume: going on from this run's own {own}; ckpt_path {chosen} is where the run started (a new"
                    " run directory starts from it again)"
                )
                self.config_init[self.subcommand]["ckpt_path"] = str(own)
        if config.get("ckpt_path") == "best":
            # Lightning finds it only after a fit in this process; with a store, on a fresh disk too. Handed over as
            # the file it is, as "last" is above: Lightning would warn that several callbacks could name a best.
            find_best_checkpoint(trainer.checkpoint_callback, self.store)
            self.config_init[self.subcommand]["ckpt_path"] = trainer.checkpoint_callback.best_model_path
        refuse_sharded_without_strategy(self._chosen_checkpoint(trainer), isinstance(trainer.strategy, ShardedStrategy))
        # The processes Lightning starts on this node stop with this one, whatever it is doing (run/stopping.py).
        stop_with_this_process(lambda: getattr(trainer.strategy.launcher, "procs", []))
        return trainer

    def _chosen_checkpoint(self, trainer: Trainer) -> Path | None:
        chosen = self.config_init[self.subcommand].get("ckpt_path")
        return None if chosen in (None, *CHECKPOINT_ALIASES) or "://" in chosen else Path(chosen)


def checked_store(settings: CheckpointStoreSettings, writable: bool) -> ObjectStore | None:
    """The checkpoint store, once it has answered: a wrong URL, credentials or bucket end the run before training."""
    if not settings.url:
        return None
    try:
        store = open_store(settings.url, settings.timeout)
        store.check(writable)
    except StoreError as error:
        raise ConfigError(f"checkpoint_store.url {error}") from None
    return store


def _show_info_logs() -> None:
    logger = logging.getLogger(__package__)
    logger.setLevel(logging.INFO)
    if not logger.handlers:
        logger.addHandler(logging.StreamHandler())


LAUNCHER_STOPS_THE_OTHERS_SECONDS = 10.0


def main(args: list[str] | None = None) -> None:
    _show_info_logs()
    quiet_library_noise()
    try:
        ProjectCLI(
            LightningModule,
            None,  # any LightningDataModule, or none (`--data null`): a model may bring its own loaders
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_callback=SaveRunRecord,
            parser_class=OneLineErrorParser,  # bad settings raise ArgumentError: one line, usage only on --help
            args=args,
        )
    except (ArgumentError, ConfigError, StoreError) as error:
        # Under torchrun and Slurm every process of a node finds the same error: the first one says it
        # and ends, and the launcher stops the others while they wait. Should the launcher not stop
        # them (an error of theirs alone), they say it after all.
        if os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")) != "0":
            time.sleep(LAUNCHER_STOPS_THE_OTHERS_SECONDS)
        tell_the_others(error, CONFIG_ERROR)
        print(f"error: {one_line(error)}", file=sys.stderr)
        sys.exit(CONFIG_ERROR)
    except (CheckpointNotWritten, CheckpointNotStored) as error:
        tell_the_others(error, CANNOT_WRITE)
        print(f"error: {error}", file=sys.stderr)
        sys.exit(CANNOT_WRITE)
    except NodesDidNotArrive as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(LOST_NODE)
    except Exception as error:
        stopping.let_an_exit_under_way_finish()  # the error followed from it: its status and line stand
        mistake = mistake_in_the_researchers_code(error)
        if mistake is not None:
            tell_the_others(error, CONFIG_ERROR)
            print(f"error: {mistake}", file=sys.stderr)
            sys.exit(CONFIG_ERROR)
        if not lost_contact(error):
            tell_the_others(error, 1)  # Python's status for the traceback below
            raise
        stopping.end_on_own_terms()  # again: Lightning put its signal handlers back since
        status = status_after(error)
        if status != LOST_NODE:  # a process of this node failed on its own: its traceback says why, not this one's
            print(error.__notes__[-1], file=sys.stderr)
            sys.exit(status)
        traceback.print_exception(error)  # ends with the line naming the lost node
        sys.exit(LOST_NODE)
    except SIGTERMException:
        # Lightning ends a process stopped by SIGTERM outside training with status 0: it did not finish.
        leave_process_group()
        sys.exit(PREEMPTED)
    except SystemExit as stop:
        if stop.code in (PREEMPTED, INTERRUPTED):  # every process stopped at the same step, after its checkpoint
            leave_process_group()
        raise
    leave_process_group()


def leave_process_group() -> None:
    """End the process group while Python is still alive, after a run that ended in step with the others.

    torch asks for it: a group left to the interpreter's exit is torn down with its backend's threads
    still running (NCCL prints a warning that pending work may not have finished). Not after a lost node:
    ending a group whose peers are gone can wait on them."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
