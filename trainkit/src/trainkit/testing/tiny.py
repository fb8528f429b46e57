"""A model and data of the machinery tests' own, not the example's: written as a researcher would, with nothing
for resuming or for clusters, so that the tests keep passing whatever becomes of the example.

The data are small noisy gray images whose class is drawn into them as a bright band: learnable in a few
steps. Samples are what image data modules give (a uint8 image (channels, height, width) and its label),
so the chunks converter and the streaming data path read them too.
"""

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule, LightningModule
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.utils.data import DataLoader, TensorDataset

from trainkit.run.errors import ConfigError

IMAGE_SIZE = 16


def tiny_images(count: int, seed: int, num_classes: int) -> tuple[Tensor, Tensor]:
    """`count` uint8 images (1, 16, 16) of noise, each with a bright band of 4 rows that says its class, and their
    labels. The rest of the noise tells the images apart."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, num_classes, (count,), generator=generator)
    images = torch.randint(0, 60, (count, 1, IMAGE_SIZE, IMAGE_SIZE), generator=generator, dtype=torch.uint8)
    band = 4 * labels[:, None] + torch.arange(4)  # rows 0-3 for class 0, 4-7 for class 1, ...
    images[torch.arange(count)[:, None], 0, band] = 255
    return images, labels


class TinyDataModule(LightningDataModule):
    """Train, val and test splits of `tiny_images` in ordinary map-style datasets and DataLoaders."""

    # What the model needs to know about the samples (the command line passes them on to it).
    in_channels = 1
    num_classes = 4

    def __init__(self, train_size: int = 576, val_size: int = 64, test_size: int = 160, batch_size: int = 32,
                 num_workers: int = 0) -> None:  # fmt: skip
        super().__init__()
        self.sizes = {"train": train_size, "val": val_size, "test": test_size}
        self.batch_size = batch_size
        self.num_workers = num_workers

    def setup(self, stage: str) -> None:
        if self.sizes["train"] < 1:
            raise ConfigError(f"data.train_size must be at least 1, got {self.sizes['train']}")
        images, labels = tiny_images(sum(self.sizes.values()), seed=0, num_classes=self.num_classes)
        start = 0
        for split, size in self.sizes.items():
            setattr(self, f"{split}_set", TensorDataset(images[start : start + size], labels[start : start + size]))
            start += size

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.test_set)

    def on_after_batch_transfer(self, batch: tuple[Tensor, Tensor], dataloader_idx: int) -> tuple[Tensor, Tensor]:
        images, labels = batch
        return images.float() / 255, labels

    def _loader(self, dataset: TensorDataset, shuffle: bool = False) -> DataLoader:
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=shuffle, num_workers=self.num_workers,
                          persistent_workers=self.num_workers > 0)  # fmt: skip


class TinyClassifier(LightningModule):
    """Images of any size pooled to 4x4, then two linear layers with dropout between them (so that training
    draws random numbers too); loss and accuracy for val and test, predictions, and a learning-rate schedule."""

    def __init__(self, in_channels: int = 1, num_classes: int = 4, hidden: int = 32, dropout: float = 0.3,
                 lr: float = 0.01) -> None:  # fmt: skip
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(in_channels * 16, hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )  # fmt: skip

    def forward(self, images: Tensor) -> Tensor:
        return self.net(images)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict[str, Tensor]:
        images, labels = batch
        confidence, predicted = self(images).softmax(dim=-1).max(dim=-1)
        return {"predicted": predicted, "confidence": confidence, "label": labels}

    def _evaluate(self, batch: tuple[Tensor, Tensor], stage: str) -> None:
        images, labels = batch
        logits = self(images)
        accuracy = (logits.argmax(dim=1) == labels).float().mean()
        metrics = {f"{stage}/loss": F.cross_entropy(logits, labels), f"{stage}/acc": accuracy}
        self.log_dict(metrics, prog_bar=True, sync_dist=True, batch_size=len(labels))

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


class TinyShardedClassifier(TinyClassifier):
    """TinyClassifier as a model author makes it ready for the sharded strategy: each layer sharded on its own."""

    def configure_model(self) -> None:
        if self.device_mesh is not None and not isinstance(self.net, FSDPModule):
            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)
