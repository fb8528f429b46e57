"""A model and data of the tests' own, not MNIST: written as a researcher would, with nothing for resuming."""

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset


class RandomFloats(LightningDataModule):
    """Random feature vectors labelled by the sign of their sum, in an ordinary map-style dataset."""

    def __init__(self, train_size: int = 200, val_size: int = 32, batch_size: int = 8, num_workers: int = 0) -> None:
        super().__init__()
        self.train_size, self.val_size = train_size, val_size
        self.batch_size = batch_size
        self.num_workers = num_workers

    def setup(self, stage: str) -> None:
        features = torch.randn(self.train_size + self.val_size, 16, generator=torch.Generator().manual_seed(0))
        labels = (features.sum(dim=1) > 0).long()
        self.train_set = TensorDataset(features[: self.train_size], labels[: self.train_size])
        self.val_set = TensorDataset(features[self.train_size :], labels[self.train_size :])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, **self._workers())

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, **self._workers())

    def _workers(self) -> dict:
        return {"num_workers": self.num_workers, "persistent_workers": self.num_workers > 0}


class TinyClassifier(LightningModule):
    """Two linear layers with dropout between them, so that training draws random numbers too."""

    def __init__(self, hidden: int = 32, dropout: float = 0.3, lr: float = 0.01) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 2))
        self.lr = lr

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        features, labels = batch
        loss = nn.functional.cross_entropy(self.net(features), labels)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        features, labels = batch
        self.log("val/acc", (self.net(features).argmax(dim=1) == labels).float().mean(), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)
