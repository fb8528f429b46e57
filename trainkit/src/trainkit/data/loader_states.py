"""Each process's own state of the training loaders that keep one, so that each process resumes its own.

A loader that keeps its own state (torchdata's StatefulDataLoader, litdata's, a stream of the
project's own with `state_dict`) may keep one of its process's own: where that process is in its
share of a stream, its shuffle buffer's generator. Lightning saves the first process's states only,
and every process gets those back: the others would resume at the first's place, perhaps in the
first's share, without a word. So every process's states go into the checkpoint, and each process
gets its own back, in place of the first's, before Lightning hands them to the loaders (as it makes
their iterators, which read them then). Resumed on another number of processes, each gets the first's,
as in Lightning, and a line says so. The kit's own loaders keep the job's place, the same on every
process (data/resumable.py, data/streaming.py): where only they keep a state, nothing is gathered.
"""

import io
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn


class LoaderStatePerProcess(Callback):
    """Keep every process's states of the training loaders in checkpoints where one of the project's own keeps a state:
    `{"ranks": [Lightning's list of loader states of rank 0, of rank 1, ...]}`; each process resumes from its own."""

    def __init__(self) -> None:
        self._trainer: Trainer | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        combined = None if self._trainer is None else self._trainer.fit_loop._combined_loader
        if combined is None or not own_stateful_loaders(combined.flattened):
            return {}  # the same answer on every process: each has the same kinds of loaders
        if not (dist.is_available() and dist.is_initialized()):
            return {}
        # Every process saves a checkpoint together (Lightning's save_checkpoint is collective), so they can meet here.
        # Sent as torch.save's bytes, as the generators' states (checkpoints/rng_state.py).
        buffer = io.BytesIO()
        torch.save(combined._state_dicts(), buffer)  # what Lightning saves of the first process
        gathered: list[bytes | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, buffer.getvalue())
        return {"ranks": [torch.load(io.BytesIO(saved), weights_only=False) for saved in gathered]}

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        ranks = checkpoint.get("callbacks", {}).get(self.state_key, {}).get("ranks")
        fit = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
        if ranks is None or "combined_loader" not in fit:  # none kept, or an epoch's end (checkpoints/epoch_end.py)
            return
        if len(ranks) == trainer.world_size:
            fit["combined_loader"] = ranks[trainer.global_rank]  # read by Lightning as it restores its loops
            return
        rank_zero_warn(
            f"exact resume: the training loader keeps a state of each process's own, saved by {len(ranks)} processes:"
            f" on {trainer.world_size} each process resumes from the first one's, and the rest of the epoch may"
            ' repeat or skip samples (docs/data.md, "Which training loaders resume mid-epoch")'
        )


def own_stateful_loaders(loaders: list[Any]) -> list[Any]:
    """Those of the training loaders that are the project's own and keep a state (not the kit's)."""
    return [
        loader
        for loader in loaders
        if hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict") and not kits_own(loader)
    ]


def kits_own(loader: Any) -> bool:
    """Whether the kit made this loader (data/resumable.py, data/streaming.py). Told by its module, not its class:
    the streaming one needs litdata, an extra that a project may not have."""
    return type(loader).__module__.startswith("trainkit.")
