"""An endless stream of noisy sine waves and a model that reads off their phase: training bounded by
`max_steps` alone, metrics named as the researcher likes (`train_mse`, `val_mse`), and two validation loaders."""

import itertools
import math

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule, LightningModule
from torch import Tensor, nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

POINTS = 16


def sines(phases: Tensor) -> Tensor:
    return torch.sin(torch.linspace(0, 6, POINTS) + phases[:, None])


class EndlessSines(IterableDataset):
    """Sine waves of random phase, for as long as they are asked for."""

    def __iter__(self):
        generator = torch.Generator().manual_seed(0)
        while True:
            phase = torch.rand(1, generator=generator) * 2 * math.pi
            yield sines(phase)[0], phase[0]


class Sines(LightningDataModule):
    """Training streams without end; validation has two fixed sets, the phases of one half a turn and the other's."""

    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(EndlessSines(), batch_size=self.batch_size)

    def val_dataloader(self) -> list[DataLoader]:
        phases = torch.rand(64, generator=torch.Generator().manual_seed(1)) * math.pi
        return [DataLoader(TensorDataset(sines(half), half), batch_size=self.batch_size)
                for half in (phases, phases + math.pi)]  # fmt: skip


class SinesOfAFiniteStream(Sines):
    """A stream of `samples` sine waves that does not say how many (no length): an epoch ends when it runs out."""

    def __init__(self, samples: int = 80, batch_size: int = 8) -> None:
        super().__init__(batch_size)
        self.samples = samples

    def train_dataloader(self) -> DataLoader:
        return DataLoader(FiniteSines(self.samples), batch_size=self.batch_size)


class FiniteSines(IterableDataset):
    def __init__(self, samples: int) -> None:
        self.samples = samples

    def __iter__(self):
        return itertools.islice(EndlessSines(), self.samples)


class PhaseReader(LightningModule):
    def __init__(self, hidden: int = 32, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(POINTS, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, waves: Tensor) -> Tensor:
        return self.net(waves).squeeze(-1)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        waves, phases = batch
        loss = F.mse_loss(self(waves), phases)
        self.log("train_mse", loss)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        waves, phases = batch
        self.log("val_mse", F.mse_loss(self(waves), phases))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
