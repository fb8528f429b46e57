"""Python's, NumPy's and torch's CPU random number generators, seeded, saved and put back as one.

The loaders draw from them (an epoch's order, a batch's augmentation) and so does the model; checkpoints keep
their state (checkpoints/rng_state.py) and the kit's own draws leave them as they were (data/own_batches.py).
"""

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch


def seed_cpu_generators(seed: int) -> None:
    """Seed Python's, NumPy's and torch's CPU generator (not the GPUs', which the model draws from)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)  # NumPy's seeds have 32 bits
    torch.default_generator.manual_seed(seed)


def cpu_generators_state() -> dict[str, Any]:
    """The three generators' state, as tensors and lists: a checkpoint holding it loads with `weights_only=True`."""
    numpy_state = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "numpy": [numpy_state[0], torch.from_numpy(numpy_state[1].copy()), *numpy_state[2:]],
        "python": [version, list(internal), gauss_next],
    }


def restore_cpu_generators(state: dict[str, Any]) -> None:
    """Put back a state from `cpu_generators_state`."""
    torch.set_rng_state(state["torch"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy(), *rest))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))


@contextlib.contextmanager
def cpu_generators_seeded(seed: int) -> Iterator[None]:
    """The generators seeded with `seed` within, and as they were again after."""
    before = cpu_generators_state()
    seed_cpu_generators(seed)
    try:
        yield
    finally:
        restore_cpu_generators(before)
