"""A GAN on points of a ring: manual optimization with two optimizers, and noise drawn in every training and
validation step (as generative models draw samples), logging a histogram of its samples with wandb's own API
(`self.logger.experiment`, not checking for a logger), for the kit's tests."""

import math

import torch
import torch.nn.functional as F
import wandb
from lightning.pytorch import LightningDataModule, LightningModule
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset


class Ring(LightningDataModule):
    """Points near the unit circle: 448 to train on, 64 to validate on."""

    def __init__(self, batch_size: int = 32) -> None:
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        generator = torch.Generator().manual_seed(0)
        angle = torch.rand(512, generator=generator) * 2 * math.pi
        radius = 1 + 0.05 * torch.randn(512, generator=generator)
        points = torch.stack([radius * angle.cos(), radius * angle.sin()], dim=1)
        self.train, self.val = TensorDataset(points[:448]), TensorDataset(points[448:])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size)


class GAN(LightningModule):
    def __init__(self, noise: int = 4, hidden: int = 32, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(noise, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, 2))
        self.discriminator = nn.Sequential(nn.Linear(2, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, 1))

    def fake(self, count: int) -> Tensor:
        return self.generator(torch.randn(count, self.hparams.noise, device=self.device))

    def discriminator_loss(self, real: Tensor) -> Tensor:
        logits = self.discriminator(torch.cat([real, self.fake(len(real)).detach()]))
        is_real = torch.cat([torch.ones(len(real), 1), torch.zeros(len(real), 1)]).to(self.device)
        return F.binary_cross_entropy_with_logits(logits, is_real)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> None:
        (real,) = batch
        generator_optimizer, discriminator_optimizer = self.optimizers()
        discriminator_optimizer.zero_grad()
        self.manual_backward(self.discriminator_loss(real))
        discriminator_optimizer.step()
        generator_optimizer.zero_grad()
        fooled = torch.ones(len(real), 1, device=self.device)
        self.manual_backward(F.binary_cross_entropy_with_logits(self.discriminator(self.fake(len(real))), fooled))
        generator_optimizer.step()

    def validation_step(self, batch: list[Tensor], batch_idx: int) -> None:
        self.log("val/discriminator_loss", self.discriminator_loss(batch[0]), sync_dist=True)
        if batch_idx == 0:  # what the generator draws, as many log samples: straight to the logger's own API
            radii = self.fake(len(batch[0])).norm(dim=1)
            self.logger.experiment.log({"val/generated_radius": wandb.Histogram(radii.detach().cpu().numpy())})

    def configure_optimizers(self) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        networks = (self.generator, self.discriminator)
        return tuple(torch.optim.Adam(network.parameters(), lr=self.hparams.lr) for network in networks)
