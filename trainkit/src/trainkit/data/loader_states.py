"""Each process's own state of the training loaders that keep one, so that each process resumes its own.

A loader that keeps its own state (torchdata's StatefulDataLoader, litdata's, a stream of the
project's own with `state_dict`) may keep one of its process's own: where that process is in its
share of a stream, its shuffle buffer's generator. Lightning saves the first process's state only,
and every process gets that back: the others would resume at the first's place, perhaps in the
first's share, without a word. So every process's state goes into the checkpoint, and each process
gets its own back when training starts. Resumed on another number of processes, each gets the
first's, as in Lightning, and a line says so. The kit's own loaders keep the job's place, the same
on every process (data/resumable.py, data/streaming.py): they are left to Lightning.
"""

import io
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn

from trainkit.data.resumable import ResumableDataLoader
from trainkit.data.streaming import ResumableStreamingDataLoader

KITS_OWN = (ResumableDataLoader, ResumableStreamingDataLoader)


class LoaderStatePerProcess(Callback):
    """Keep every process's state of the project's own stateful training loaders in checkpoints:
    `{"ranks": [[state of each loader] of rank 0, of rank 1, ...]}`; each process resumes from its own."""

    def __init__(self) -> None:
        self._trainer: Trainer | None = None
        self._resumed: list[list[dict[str, Any]]] | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        loaders = own_stateful_loaders(self._trainer)
        if not loaders or not (dist.is_available() and dist.is_initialized()):
            return {}  # the same answer on every process: each has the same kinds of loaders
        # Every process saves a checkpoint together (Lightning's save_checkpoint is collective), so they can meet here.
        # Sent as torch.save's bytes, as the generators' states (checkpoints/rng_state.py).
        buffer = io.BytesIO()
        torch.save([loader.state_dict() for loader in loaders], buffer)
        gathered: list[bytes | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, buffer.getvalue())
        return {"ranks": [torch.load(io.BytesIO(saved), weights_only=False) for saved in gathered]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resumed = state.get("ranks")

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After Lightning handed every process the first one's states, before the first batch is drawn.
        if self._resumed is None:
            return
        states, self._resumed = self._resumed, None
        loaders = own_stateful_loaders(trainer)
        if len(states) != trainer.world_size:
            names = ", ".join(sorted({type(loader).__name__ for loader in loaders}))
            rank_zero_warn(
                f"exact resume: the training loader ({names}) keeps a state of each process's own, saved by"
                f" {len(states)} processes: on {trainer.world_size} each process resumes from the first one's"
                ' (docs/data.md, "Which training loaders resume mid-epoch")'
            )
            return
        for loader, state in zip(loaders, states[trainer.global_rank], strict=True):
            loader.load_state_dict(state)


def own_stateful_loaders(trainer: Trainer | None) -> list[Any]:
    """The training loaders of the project's own that keep a state (not the kit's), in Lightning's order."""
    combined = None if trainer is None else trainer.fit_loop._combined_loader
    if combined is None:
        return []
    return [
        loader
        for loader in combined.flattened
        if hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict") and not isinstance(loader, KITS_OWN)
    ]
