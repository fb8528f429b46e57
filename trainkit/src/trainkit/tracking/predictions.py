"""Write what `python train.py predict` computes to a CSV file a person can open."""

import csv
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import Tensor


class PredictionWriter(BasePredictionWriter):
    """One row per image: its index in the dataset, the predicted class, the confidence and the label.

    With several processes each writes its own part, `predictions-rank<N>.csv`.
    """

    def __init__(self, output_dir: str | None = None) -> None:
        super().__init__(write_interval="batch")
        # output_dir None: the command line puts the file in trainer.default_root_dir.
        self.output_dir = Path(output_dir or ".")
        self._rows: list[list[Any]] = []

    def on_predict_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._rows = []

    def write_on_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        prediction: dict[str, Tensor],
        batch_indices: list[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        count = len(prediction["predicted"])
        indices = batch_indices if batch_indices is not None else [None] * count
        columns = (prediction[key].tolist() for key in ("predicted", "confidence", "label"))
        self._rows.extend([index, *values] for index, *values in zip(indices, *columns, strict=True))

    def on_predict_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        name = "predictions.csv" if trainer.world_size == 1 else f"predictions-rank{trainer.global_rank}.csv"
        self.output_dir.mkdir(parents=True, exist_ok=True)
        with (self.output_dir / name).open("w", newline="") as file:
            writer = csv.writer(file)
            writer.writerow(["index", "predicted", "confidence", "label"])
            writer.writerows(self._rows)
