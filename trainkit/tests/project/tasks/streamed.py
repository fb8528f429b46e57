"""A table read as a stream, each process reading its own share, by a loader that keeps its own state.

As a reader of files split by process would, each process takes every `world_size`-th row from its
rank on, and its loader's state is the index of its next row in the whole stream: a place of its
process's own. Given another process's state, a process would read that process's share.
"""

from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback
from torch.utils.data import DataLoader, Dataset, IterableDataset

from tasks.regression import Regressor, Table


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class ItsShareOfAStream(IterableDataset):
    def __init__(self, rows: Dataset) -> None:
        self.rows = rows
        self.next_row: int | None = None  # where this process is in the stream; None: at the start of its share

    def __iter__(self) -> Iterator[Any]:
        # Where to start is read as the iterator is made, not at its first row, as torchdata's StatefulDataLoader does:
        # Lightning makes the iterator before the first batch, and a state loaded later would count for the next epoch.
        rank, world = rank_and_world()
        in_the_share = self.next_row is not None and self.next_row < len(self.rows)
        start = self.next_row if in_the_share else rank  # past the end: the share was read, a new epoch reads it again
        return self._rows_from(start, world)

    def _rows_from(self, start: int, world: int) -> Iterator[Any]:
        for row in range(start, len(self.rows), world):
            self.next_row = row + world
            yield self.rows[row]

    def __len__(self) -> int:
        rank, world = rank_and_world()
        return len(range(rank, len(self.rows), world))


class StreamLoader(DataLoader):
    """Batches of the stream, in the order it gives them; its state is the stream's place."""

    def state_dict(self) -> dict[str, int | None]:
        return {"next_row": self.dataset.next_row}

    def load_state_dict(self, state: dict[str, int | None]) -> None:
        self.dataset.next_row = state["next_row"]


class StreamedTable(Table):
    """The table's training rows as each process's own stream."""

    def train_dataloader(self) -> DataLoader:
        return StreamLoader(ItsShareOfAStream(self.train), batch_size=self.batch_size)


class RegressorOfAStream(Regressor):
    """The regressor without its early stop: the stream's place of 2 processes leaves fewer rows on 1 than Lightning
    counts, and Lightning ends such an epoch without validating, where EarlyStopping finds no score."""

    def configure_callbacks(self) -> list[Callback]:
        return []
