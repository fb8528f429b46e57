"""The model `strategies/sharded.py` times checkpoint saves with, and the clock it adds to those runs.

The example model's checkpoint is 5 MB: its save takes a few hundredths of a second either way.
Saving matters from a few hundred MB on, so the saves are timed on a stack of square Linear layers
of that size, trained with AdamW (whose two moments per parameter make the checkpoint three times
the weights) on random vectors. It shards itself in `configure_model` as the example model does,
so the same class runs under DDP and under the sharded strategy.

Each weight matrix stays under 32 MB (width 2048: 16 MB): FSDP gathers every layer's full
weights before using them and frees them after, and glibc's malloc maps a block above 32 MB
fresh from the system at each allocation (page faults at every step) whatever the benchmark's
malloc settings.
"""

import json
import resource
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.utils.data import DataLoader, TensorDataset


class WideMLP(LightningModule):
    """`depth` Linear(width, width) layers with ReLUs between them, trained to map random vectors to random vectors."""

    def __init__(self, width: int = 2048, depth: int = 12, lr: float = 1e-4) -> None:
        super().__init__()
        self.save_hyperparameters()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.net = nn.Sequential(*layers[:-1])

    def configure_model(self) -> None:
        # As the example model: only the sharded strategy sets a device mesh; DDP and one device keep whole layers.
        if self.device_mesh is not None and not isinstance(self.net, FSDPModule):
            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        return F.mse_loss(self.net(inputs), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class RandomVectors(LightningDataModule):
    """Random input and target vectors, the same in every process (the sampler gives each process its share)."""

    def __init__(self, width: int = 2048, samples: int = 256, batch_size: int = 4) -> None:
        super().__init__()
        self.width = width
        self.samples = samples
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        inputs, targets = torch.randn(2, self.samples, self.width, generator=generator)
        return DataLoader(TensorDataset(inputs, targets), batch_size=self.batch_size, shuffle=True)


class StepEnds(Callback):
    """Reads the clock after each training step (after the callbacks before it, so after a periodic save), and
    writes `<out>.rank<N>.json` at the end: those times and the process's peak memory."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.ends: list[float] = []
        self.steps: list[int] = []

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        self.ends.append(time.perf_counter())
        self.steps.append(trainer.global_step)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports kilobytes
        figures = {"steps": self.steps, "ends": self.ends, "peak_rss_bytes": peak_bytes}
        Path(f"{self.out}.rank{trainer.global_rank}.json").write_text(json.dumps(figures))
