"""The tests' tiny model drawing randomness of each process's own: a resume must give each process its own back."""

import os
import random

import numpy as np
import torch
from torch import Tensor

from trainkit.testing.tiny import TinyShardedClassifier


class RankNoise(TinyShardedClassifier):
    """Seeds each process's generators with the job's seed plus its rank, and adds noise from all three (torch,
    numpy, Python) to the training images: each process draws its own noise and dropout masks."""

    def on_fit_start(self) -> None:
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0)) + self.global_rank
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, labels = batch
        noise = torch.rand_like(images) + float(np.random.rand()) + random.random()
        return super().training_step((images + 0.1 * noise, labels), batch_idx)
