"""Data modules and models broken on purpose: each problem must be named in one line."""

import numpy as np
from torch.utils.data import BatchSampler, DataLoader, RandomSampler

from tasks.regression import Regressor, Table
from trainkit import ConfigError


class BatchesOfItsOwn(Table):
    """Batches drawn by a batch sampler of its own: Lightning cannot resume them mid-epoch."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_sampler=BatchSampler(RandomSampler(self.train), 16, drop_last=False))


class RefusesItsRoot(Table):
    def __init__(self, root: str = "corpus") -> None:
        raise ConfigError(f"data.root {root!r} holds no table")


class SetsUpOnlyForFit(Table):
    """Validation data made for `fit` only: Lightning calls `setup("validate")` before `validate`."""

    def setup(self, stage: str) -> None:
        if stage == "fit":
            super().setup(stage)


class KeepsNumpyNumbers(Regressor):
    """A model that keeps a numpy number in its checkpoints: a job resuming by itself refuses to load them."""

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["target_scale"] = np.float64(2.5)
