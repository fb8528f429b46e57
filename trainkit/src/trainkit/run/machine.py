"""What a fit needs of the machine, checked as it starts: a compiler for a compiled model (run/compiler.py),
/dev/shm enough for NCCL and the loader workers (run/shared_memory.py), a Python whose fork of a loader worker
cannot hang (run/worker_start.py)."""

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader

from trainkit.run.compiler import compile_problem, compiled_modules
from trainkit.run.errors import ConfigError
from trainkit.run.shared_memory import SHARED_MEMORY, shared_memory_warning, size_of
from trainkit.run.worker_start import stuck_fork_warning

log = logging.getLogger(__name__)


class CheckThisMachine(Callback):
    """Refuse a compiled model where there is no compiler; warn a node short of /dev/shm, or on a Python whose fork
    of a loader worker can hang, once."""

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After configure_model, where models compile, and before the sanity check runs the first compiled step.
        # `pl_module` is the researcher's module, never the strategy's wrapper around it.
        if not compiled_modules(pl_module):
            return
        problem = compile_problem(pl_module, trainer.strategy.root_device.type)
        # Every process stops, not only those short of a compiler: the others would wait for them in vain.
        if trainer.strategy.reduce_boolean_decision(problem is not None, all=False):
            raise ConfigError(problem or "another node of this job has no C compiler for torch.compile: see its log")

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Once the training loaders exist; one line per node, from its first process.
        if trainer.local_rank != 0:
            return
        gpus = trainer.num_devices if trainer.strategy.root_device.type == "cuda" else 0  # gloo needs no /dev/shm
        workers = loader_workers(trainer.train_dataloader)
        for warning in (
            shared_memory_warning(size_of(SHARED_MEMORY), gpus, workers),
            stuck_fork_warning(trainer.world_size, workers),
        ):
            if warning is not None:
                log.warning(warning)


def loader_workers(loaders: Any) -> int:
    """The most worker processes of any DataLoader among `loaders`: one, or a list or dict of them."""
    if isinstance(loaders, DataLoader):
        return loaders.num_workers
    if isinstance(loaders, Mapping):
        loaders = list(loaders.values())
    if isinstance(loaders, Sequence) and not isinstance(loaders, str):
        return max(map(loader_workers, loaders), default=0)
    return 0
