"""The random number generators' state in checkpoints, each process's own, so a resumed run stays on course."""

import io
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer

from trainkit.data.generators import cpu_generators_state, restore_cpu_generators, seed_cpu_generators


class RNGStateCheckpoint(Callback):
    """Keep every process's random number generators' state in checkpoints, so a resumed run draws what it would have.

    Each process keeps its own: Python's `random`, numpy's, torch's CPU generator and that of its own GPU (the
    current CUDA device). Lightning saves the first process's callback state only (the sharded strategy too, in
    its `meta.pt`), so saving gathers every process's state there: `{"ranks": [state of rank 0, of rank 1, ...]}`.

    On resuming, a process gets its own rank's state back. A process the checkpoint has none for (the job has
    more processes than the one that saved) gets the first process's state re-seeded with its rank: a stream
    of its own, the same on every resume. Processes that drew alike before (one seed everywhere) draw apart
    from there. A checkpoint of the earlier format (one state, the first process's, with every visible GPU's
    generator) counts as the first process's state.

    States are stored as tensors and lists: checkpoints must load with `weights_only=True`. A resumed run gets
    them back when training starts, not when Lightning reads the checkpoint: it does that before it asks for
    the loaders and runs the sanity check, and what those draw (Lightning's own demo data draws its samples
    when its loader is made) must be what the first run drew.

    Validation draws from a copy: the generators are put back as they were before it once it ends, and a
    checkpoint saved during it keeps them as they were. What a model draws in validation (a generative model's
    samples, its noise) so leaves training's draws as they are: a run resumed from a checkpoint saved before an
    epoch's validation, which it does not run again (checkpoints/epoch_end.py), trains as an uninterrupted one,
    and so does a run that validates more or less often.
    """

    def __init__(self) -> None:
        self._resumed: list[dict[str, Any]] | None = None
        self._before_validation: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        state = self._before_validation or current_state()
        if not (dist.is_available() and dist.is_initialized()):
            return {"ranks": [state]}
        # Every process saves a checkpoint together (Lightning's save_checkpoint is collective), so they can meet here.
        # Sent as torch.save's bytes: all_gather_object's pickle loses uint32 tensors (numpy's state) in torch 2.14.
        buffer = io.BytesIO()
        torch.save(state, buffer)
        gathered: list[bytes | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, buffer.getvalue())
        return {"ranks": [torch.load(io.BytesIO(saved), weights_only=True) for saved in gathered]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resumed = state["ranks"] if "ranks" in state else [from_earlier_format(state)]

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._before_validation = current_state()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        restore(self._before_validation)
        self._before_validation = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._resumed is None:
            return
        states, self._resumed = self._resumed, None
        rank = trainer.global_rank
        if rank < len(states):
            restore(states[rank])
        else:
            reseed(states[0], rank)


def current_state() -> dict[str, Any]:
    """This process's generators: tensors and lists only."""
    state = cpu_generators_state()
    if torch.cuda.is_initialized():  # a process that never used CUDA has drawn nothing there
        state["cuda"] = torch.cuda.get_rng_state()  # the current device's: this process's GPU
    return state


def restore(state: dict[str, Any]) -> None:
    restore_cpu_generators(state)
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def reseed(first: dict[str, Any], rank: int) -> None:
    """Seed every generator of this process with a number drawn from the first process's state plus `rank`."""
    generator = torch.Generator()
    generator.set_state(first["torch"])
    seed = int(torch.randint(2**31, (1,), generator=generator)) + rank
    seed_cpu_generators(seed)
    torch.cuda.manual_seed_all(seed)  # lazily, where CUDA is not started yet


def from_earlier_format(state: dict[str, Any]) -> dict[str, Any]:
    """A state saved before states were per process: the first process's, with every visible GPU's generator."""
    if "cuda" not in state:
        return state
    return {**state, "cuda": state["cuda"][0]}  # cuda:0, the first process's GPU
