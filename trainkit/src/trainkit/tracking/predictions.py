"""Write what `python train.py predict` computes to a CSV file a person can open."""

import csv
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import Tensor


class PredictionWriter(BasePredictionWriter):
    """One row per sample: its index in the dataset, then what `predict_step` returned for it.

    `predict_step` may return a tensor (one column, `prediction`), a dict of them (a column per key: a classifier's
    `predicted`, `confidence` and `label`), a tuple of them (`prediction_0`, `prediction_1`, ...), or per-sample
    lists such as generated text. A sample's value of more
    than one number (logits, a token sequence) is written as its numbers separated by spaces. With several
    processes each writes its own part, `predictions-rank<N>.csv`.
    """

    def __init__(self, output_dir: str | None = None) -> None:
        super().__init__(write_interval="batch")
        # output_dir None: the command line puts the file in trainer.default_root_dir.
        self.output_dir = Path(output_dir or ".")
        self._rows: list[dict[str, Any]] = []

    def on_predict_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._rows = []
        if trainer.is_global_zero:  # an earlier predict's files on another number of processes would read as this one's
            for stale in self.output_dir.glob("predictions*.csv"):
                if stale.name not in _file_names(trainer.world_size):
                    stale.unlink()

    def write_on_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        prediction: Any,
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        if prediction is None:
            return
        cells = {name: per_sample(value) for name, value in columns(prediction).items()}
        count = max(len(values) for values in cells.values())
        indices = list(batch_indices) if batch_indices is not None else [""] * count
        for name, values in cells.items():
            if len(values) not in (1, len(indices)):
                raise ValueError(
                    f"predict_step returned {name!r} with {len(values)} values for a batch of {len(indices)} samples:"
                    " return one value per sample, or one for the whole batch"
                )
        for row, index in enumerate(indices):
            values = {name: values[row] if len(values) > 1 else values[0] for name, values in cells.items()}
            self._rows.append({"index": index, **values})

    def on_predict_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        name = _file_names(trainer.world_size)[trainer.global_rank]
        self.output_dir.mkdir(parents=True, exist_ok=True)
        header = list(dict.fromkeys(column for row in self._rows for column in row)) or ["index"]
        with (self.output_dir / name).open("w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=header)
            writer.writeheader()
            writer.writerows(self._rows)


def _file_names(processes: int) -> list[str]:
    """Each process's file, by its global rank."""
    return ["predictions.csv"] if processes == 1 else [f"predictions-rank{rank}.csv" for rank in range(processes)]


def columns(prediction: Any) -> Mapping[str, Any]:
    """What `predict_step` returned, by column name."""
    if isinstance(prediction, Mapping):
        return prediction
    if isinstance(prediction, tuple):  # values side by side (a list is one value per sample)
        return {f"prediction_{place}": value for place, value in enumerate(prediction)}
    return {"prediction": prediction}


def per_sample(value: Any) -> list[Any]:
    """A batch's value as one cell per sample; a single value (a number for the whole batch) as one cell."""
    if isinstance(value, Tensor):
        value = value.detach().cpu()
        if value.ndim == 0:
            return [cell(value)]
    if isinstance(value, Tensor) or (isinstance(value, Sequence) and not isinstance(value, str)):
        return [cell(sample) for sample in value]
    return [value]


def cell(sample: Any) -> Any:
    """A number, a text, or a sample's numbers separated by spaces (logits, a token sequence)."""
    if not isinstance(sample, Tensor):
        return sample
    if sample.dtype in (torch.float16, torch.bfloat16):  # numpy has no bfloat16
        sample = sample.float()
    # numpy writes a float32 with the fewest digits that read back the same: 0.9, not 0.8999999761581421.
    return " ".join(str(number) for number in sample.flatten().numpy())
