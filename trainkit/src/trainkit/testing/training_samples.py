"""A test-only callback: each process records which samples it trains on, batch by batch.

Lines are appended as batches start, so the record of a run that is stopped half-way survives
and a resumed run continues it.
"""

import hashlib
import json
from collections import defaultdict
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer


def sample_ids(images: torch.Tensor) -> list[str]:
    """One id per image: a digest of its pixels (the test images are all different)."""
    return [hashlib.sha256(image.cpu().numpy().tobytes()).hexdigest()[:16] for image in images]


class RecordTrainingSamples(Callback):
    """Append `{"epoch": ..., "samples": [...]}` to `<out_dir>/rank<global rank>.jsonl` for every batch."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"epoch": trainer.current_epoch, "samples": sample_ids(batch[0])})
        with (self.out_dir / f"rank{trainer.global_rank}.jsonl").open("a") as record:
            record.write(line + "\n")


def recorded(out_dir: Path, rank: int) -> dict[int, list[str]]:
    """The samples one process trained on in each epoch, in order."""
    epochs: dict[int, list[str]] = defaultdict(list)
    for line in (out_dir / f"rank{rank}.jsonl").read_text().splitlines():
        batch = json.loads(line)
        epochs[batch["epoch"]].extend(batch["samples"])
    return dict(epochs)
