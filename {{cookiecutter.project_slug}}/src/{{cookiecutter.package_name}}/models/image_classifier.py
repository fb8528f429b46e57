"""The example model: a small CNN (`ConvNet`) and the LightningModule that trains it to classify images."""

from typing import Annotated

import torch
import torch.nn.functional as F
from annotated_types import Ge, Le
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from pydantic import PositiveInt
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy


class ConvNet(nn.Module):
    """Two conv blocks and a classifier head for images of any size; returns logits (B, num_classes)."""

    def __init__(
        self, in_channels: int = 1, num_classes: int = 10, channels: int = 32, hidden: int = 128, dropout: float = 0.25
    ):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, channels, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 28x28 -> 14x14
            nn.Conv2d(channels, 2 * channels, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 14x14 -> 7x7
            nn.AdaptiveAvgPool2d(7),  # other sizes -> 7x7 too (28x28 images pass unchanged)
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Dropout(dropout),
            nn.Linear(2 * channels * 7 * 7, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, images: Tensor) -> Tensor:
        return self.classifier(self.features(images))


class ImageClassifier(LightningModule):
    """Trains `ConvNet` with cross-entropy and reports accuracy for train, val and test.

    `in_channels` and `num_classes` come from the data module's attributes of the same names
    (linked by the command line), so the same config trains on any image data module.
    The optimizer and learning-rate scheduler are injected (see `configs/model/image_classifier.yaml`),
    so trying another one is a config change, not a code change. `compile: true` runs the
    network through `torch.compile`: faster steps on GPUs once the first steps have compiled it.
    The types' limits (PositiveInt, a dropout in [0, 1]) are checked when the config is parsed.
    """

    def __init__(
        self,
        in_channels: PositiveInt = 1,
        num_classes: PositiveInt = 10,
        channels: PositiveInt = 32,
        hidden: PositiveInt = 128,
        dropout: Annotated[float, Ge(0), Le(1)] = 0.25,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        scheduler: LRSchedulerCallable | None = None,
        compile: bool = False,
    ):
        super().__init__()
        # The optimizer and scheduler are callables, not data: LightningCLI records them in the config.
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        self.net = ConvNet(in_channels, num_classes, channels, hidden, dropout)
        self.optimizer = optimizer
        self.scheduler = scheduler
        # Nothing in a training step waits for the GPU (which would stop the CPU from queueing the next
        # steps' work): the training accuracy is the mean of correct predictions, kept on the device
        # (nan_strategy="disable": no NaN check, which reads a value back; a comparison is never NaN).
        # MulticlassAccuracy counts with torch.bincount, which on a GPU reads the labels' minimum and
        # maximum back to the CPU at every update: fine once per validation batch, not at every step.
        # validate_args=False: no checks of the inputs at every update (cross_entropy checks the labels).
        self.train_accuracy = MeanMetric(nan_strategy="disable")
        self.val_accuracy = MulticlassAccuracy(num_classes, average="micro", validate_args=False)
        self.test_accuracy = MulticlassAccuracy(num_classes, average="micro", validate_args=False)

    def configure_model(self) -> None:
        # Under the sharded strategy (configs/strategy/fsdp.yaml) each process keeps a part of every
        # weight. Each block is sharded on its own, so a process gathers one block's weights at a time.
        # Under DDP and on one device there is no mesh and nothing to do; Lightning may call this hook
        # again in the same process (fit, then test), hence the check that it is not sharded yet.
        if self.device_mesh is not None and not isinstance(self.net, FSDPModule):
            mesh = self.device_mesh["data_parallel"]
            fully_shard(self.net.features, mesh=mesh)
            fully_shard(self.net.classifier, mesh=mesh)
            fully_shard(self.net, mesh=mesh)
        # Compiled in place, after sharding: the checkpoint's parameter names stay those of the plain network.
        if self.hparams.compile:
            self.net.compile()

    def forward(self, images: Tensor) -> Tensor:
        return self.net(images)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, labels = batch
        logits = self(images)
        loss = F.cross_entropy(logits, labels)
        # Accumulate only; the epoch's accuracy is computed and logged once, in on_train_epoch_end.
        self.train_accuracy.update((logits.argmax(dim=-1) == labels).float())
        if self._logger_records_this_step():
            self.log("train/loss", loss, prog_bar=True)
        return loss

    def _logger_records_this_step(self) -> bool:
        """Whether Lightning hands this step's logged values to the logger: every `trainer.log_every_n_steps`.

        Each self.log call costs about 0.6 ms of Lightning's bookkeeping on a CPU (bench/README.md in the
        template repository); on other steps the value would only refresh the progress bar.
        """
        if self._trainer is None:  # called by hand, outside a Trainer: self.log would do nothing
            return False
        every = self.trainer.log_every_n_steps
        return every > 0 and (self.global_step + 1) % every == 0

    def on_train_epoch_end(self) -> None:
        self.log("train/acc", self.train_accuracy)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_accuracy)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_accuracy)

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict[str, Tensor]:
        images, labels = batch
        probabilities = self(images).softmax(dim=-1)
        confidence, predicted = probabilities.max(dim=-1)
        return {"predicted": predicted, "confidence": confidence, "label": labels}

    def _evaluate(self, batch: tuple[Tensor, Tensor], stage: str, accuracy: MulticlassAccuracy) -> None:
        images, labels = batch
        logits = self(images)
        accuracy.update(logits, labels)  # computed over the whole epoch when it is logged
        self.log(f"{stage}/loss", F.cross_entropy(logits, labels), sync_dist=True)
        self.log(f"{stage}/acc", accuracy, prog_bar=True)

    def configure_optimizers(self):
        optimizer = self.optimizer(self.parameters())
        if self.scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": self.scheduler(optimizer)}
