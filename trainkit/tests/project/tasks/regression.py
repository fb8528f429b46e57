"""A regression model on a table (a CSV file): a task unlike image classification, for the kit's tests.

It logs `val_loss` only, and keeps its own checkpoints of it and stops early by it (`configure_callbacks`), as many
Lightning examples do."""

import csv
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningDataModule, LightningModule
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    Subset,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
    random_split,
)

from trainkit import ConfigError

FLATS = Path(__file__).with_name("flats.csv")


class Table(LightningDataModule):
    """The rows of a CSV file: every column but `target` is a feature, standardised by the training rows."""

    def __init__(self, path: str = str(FLATS), target: str = "price", batch_size: int = 16) -> None:
        super().__init__()
        with open(path, newline="") as file:
            rows = list(csv.DictReader(file))
        if not rows or target not in rows[0]:
            raise ConfigError(f"data.target {target!r} is not a column of {path}")
        features = [name for name in rows[0] if name != target]
        self.x = torch.tensor([[float(row[name]) for name in features] for row in rows])
        self.y = torch.tensor([float(row[target]) for row in rows])
        self.in_features = len(features)  # the model's in_features, passed on by name
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        table = TensorDataset((self.x - self.x.mean(0)) / self.x.std(0), (self.y - self.y.mean()) / self.y.std())
        self.train, self.val = random_split(table, [0.8, 0.2], generator=torch.Generator().manual_seed(0))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size)


class WeightedTable(Table):
    """The table's rows drawn by weight, with replacement: the rarest prices (far from the mean) the most often."""

    def train_dataloader(self) -> DataLoader:
        targets = torch.stack([target for _, target in self.train])
        sampler = WeightedRandomSampler(1 + targets.abs(), num_samples=len(self.train), replacement=True)
        return DataLoader(self.train, batch_size=self.batch_size, sampler=sampler)


class SplitByIndices(Table):
    """The training rows drawn by a SubsetRandomSampler over the whole table, as older code splits a dataset."""

    def train_dataloader(self) -> DataLoader:
        rows = SubsetRandomSampler(self.train.indices)
        return DataLoader(self.train.dataset, batch_size=self.batch_size, sampler=rows)


class SharedOutByItself(Table):
    """The training rows shared out over the processes by a DistributedSampler of the data module's own, as code
    written for plain PyTorch's DDP does."""

    def train_dataloader(self) -> DataLoader:
        if not dist.is_initialized():
            return super().train_dataloader()
        return DataLoader(self.train, batch_size=self.batch_size, sampler=DistributedSampler(self.train, seed=5))


class LabeledAndUnlabeled(Table):
    """Semi-supervised: a quarter of the training rows labeled, and every training row's features. Two training loaders,
    which Lightning combines into one batch of each, cycling the shorter one through the epoch."""

    def train_dataloader(self) -> dict[str, DataLoader]:
        labeled = Subset(self.train, range(len(self.train) // 4))
        return {
            "labeled": DataLoader(labeled, batch_size=self.batch_size, shuffle=True),
            "unlabeled": DataLoader(self.train, batch_size=self.batch_size, shuffle=True),
        }


class JitteredRows(Dataset):
    """Rows whose features get new noise each time they are read, as augmentation adds it (in a loader's workers)."""

    def __init__(self, rows: Dataset, scale: float = 0.1) -> None:
        self.rows, self.scale = rows, scale

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        features, target = self.rows[index]
        return features + self.scale * torch.randn_like(features), target


class AugmentedTable(Table):
    """The training rows jittered by two loader workers, kept from one epoch to the next."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(JitteredRows(self.train), batch_size=self.batch_size, shuffle=True, num_workers=2,
                          persistent_workers=True)  # fmt: skip


class Regressor(LightningModule):
    def __init__(self, in_features: int, hidden: int = 32, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(in_features, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, 1)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x).squeeze(-1)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)

    def configure_callbacks(self) -> list[Callback]:
        return [ModelCheckpoint(monitor="val_loss", filename="lowest-{epoch}"), EarlyStopping("val_loss", patience=5)]


class SemiSupervisedRegressor(Regressor):
    """Fits the labeled rows, and keeps its predictions on every row steady when their features are jittered."""

    def training_step(self, batch: dict[str, tuple[Tensor, Tensor]], batch_idx: int) -> Tensor:
        x, y = batch["labeled"]
        rows, _ = batch["unlabeled"]  # their targets go unused
        jittered = rows + 0.1 * torch.randn_like(rows)
        return F.mse_loss(self(x), y) + F.mse_loss(self(jittered), self(rows).detach())
