"""Data modules and models broken on purpose: each problem must be named in one line."""

from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader

from tasks.regression import Regressor, Table
from trainkit import ConfigError


class ShuffledBatches:
    """A batch sampler written from scratch with no length, as one whose number of batches is known only once drawn
    (batches up to a budget of tokens)."""

    def __init__(self, size: int, batch_size: int) -> None:
        self.size, self.batch_size = size, batch_size

    def __iter__(self) -> Iterator[list[int]]:
        return iter(batch.tolist() for batch in torch.randperm(self.size).split(self.batch_size))


class BatchesOfItsOwn(Table):
    """Batches drawn by a batch sampler with no length: the kit cannot tell where in its epoch a run stopped."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_sampler=ShuffledBatches(len(self.train), 16))


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


class MultipliesTheWrongShapes(Regressor):
    """A training step with a matrix one row too many for the features: an error deep in the model's own code."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        features, _ = batch
        return (features @ torch.ones(features.shape[1] + 1, 1)).mean()


class WarmsUpOnAPlainCounter(Regressor):
    """A loss warmed up over the first steps by a counter kept in a plain attribute: a resumed run starts it over."""

    warmup_steps = 20
    steps_taken = 0

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.steps_taken += 1
        return super().training_step(batch, batch_idx) * min(1.0, self.steps_taken / self.warmup_steps)


class AnnealsAtEachEpochsEnd(Regressor):
    """A loss weight kept in a registered buffer and halved at each epoch's end: the checkpoint keeps it, but a run
    stopped at an epoch's last step resumes without that epoch's end (checkpoints/epoch_end.py)."""

    def __init__(self, in_features: int, hidden: int = 32, lr: float = 1e-2) -> None:
        super().__init__(in_features, hidden, lr)
        self.register_buffer("loss_weight", torch.tensor(1.0))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * self.loss_weight

    def on_train_epoch_end(self) -> None:
        self.loss_weight /= 2


class FailsOnOneProcess(Regressor):
    """A bug that only one process's share of the data meets: that process (global rank `failing_rank`) raises at its
    third step."""

    def __init__(self, in_features: int, hidden: int = 32, lr: float = 1e-2, failing_rank: int = 1) -> None:
        super().__init__(in_features, hidden, lr)
        self.failing_rank = failing_rank

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.global_rank == self.failing_rank and self.global_step == 2:
            raise RuntimeError(f"a row that only global rank {self.failing_rank} reads")
        return super().training_step(batch, batch_idx)


class FailsToDownload(Table):
    """A download that fails on one node (a checksum that does not match): its first process raises in
    `prepare_data`, while the other processes of the job wait in Lightning's barrier, which has no timeout."""

    def __init__(self, failing_node: int = 1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.failing_node = failing_node

    def prepare_data(self) -> None:
        if self.trainer.node_rank == self.failing_node:
            raise RuntimeError(f"the download's checksum does not match on node {self.failing_node}")


class LogsANameLightningRefuses(Regressor):
    """A metric named as Lightning names those of several validation loaders, which it refuses from `self.log`."""

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss/dataloader_idx_0", torch.nn.functional.mse_loss(self(x), y))


class DivergesToNaN(Regressor):
    """A loss that is not a number from the first step: the weights, and every score after, are NaN."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * float("nan")


class ReducesOnAMetricItNeverLogs(Regressor):
    """A ReduceLROnPlateau on `val/rmse`, where validation logs `val_loss` only: Lightning finds out at the first
    epoch's end."""

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.01)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "val/rmse"}}
