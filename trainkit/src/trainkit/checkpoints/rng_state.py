"""The random number generators' state in checkpoints, so a resumed run stays on course."""

import random
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer


class RNGStateCheckpoint(Callback):
    """Keep the random number generators' state in checkpoints, so a resumed run draws what it would have.

    States are stored as tensors and lists: checkpoints must load with `weights_only=True`. A resumed run gets
    them back when training starts, not when Lightning reads the checkpoint: it does that before it asks for
    the loaders and runs the sanity check, and what those draw (Lightning's own demo data draws its samples
    when its loader is made) must be what the first run drew.
    """

    def __init__(self) -> None:
        self._resumed: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        numpy_state = np.random.get_state()
        version, internal, gauss_next = random.getstate()
        state = {
            "torch": torch.get_rng_state(),
            "numpy": [numpy_state[0], torch.from_numpy(numpy_state[1].copy()), *numpy_state[2:]],
            "python": [version, list(internal), gauss_next],
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resumed = state

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._resumed is not None:
            restore(self._resumed)
            self._resumed = None


def restore(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy(), *rest))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
