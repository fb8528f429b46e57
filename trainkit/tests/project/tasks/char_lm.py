"""A character-level language model on text files: a task unlike image classification, for the kit's tests."""

import random
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule, LightningModule
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, Sampler, TensorDataset

from trainkit import ConfigError


class TextFiles(LightningDataModule):
    """Windows of `context` characters from the text files in `root`, each with the window one character on."""

    def __init__(self, root: str, pattern: str = "*.md", context: int = 32, batch_size: int = 16) -> None:
        super().__init__()
        files = sorted(Path(root).glob(pattern))
        if not files:
            raise ConfigError(f"data.root {root!r} holds no {pattern} files")
        self.text = "".join(file.read_text() for file in files)
        self.characters = sorted(set(self.text))
        self.vocab_size = len(self.characters)  # the model's vocab_size, passed on by name
        self.context, self.batch_size = context, batch_size

    def setup(self, stage: str) -> None:
        index = {character: i for i, character in enumerate(self.characters)}
        ids = torch.tensor([index[character] for character in self.text])
        windows = ids[: len(ids) // (self.context + 1) * (self.context + 1)].view(-1, self.context + 1)
        held_out = len(windows) // 10
        self.train = TensorDataset(windows[held_out:, :-1], windows[held_out:, 1:])
        self.held_out = TensorDataset(windows[:held_out, :-1], windows[:held_out, 1:])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.held_out, batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.held_out, batch_size=self.batch_size)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.held_out, batch_size=self.batch_size)


class LinesByLength(TextFiles):
    """The text's lines (up to `context` characters), each batched with lines of about its length by a batch sampler
    of the data module's own, as language models batch sentences; the batches are padded to their longest line."""

    def setup(self, stage: str) -> None:
        index = {character: i for i, character in enumerate(self.characters)}
        lines = [torch.tensor([index[c] for c in line[: self.context + 1]]) for line in self.text.splitlines()]
        pairs = [(line[:-1], line[1:]) for line in lines if len(line) > 1]
        held_out = len(pairs) // 10
        self.train, self.held_out = pairs[held_out:], pairs[:held_out]

    def train_dataloader(self) -> DataLoader:
        lengths = [len(ids) for ids, _ in self.train]
        batches = BatchesOfLength(RandomSampler(self.train), self.batch_size, drop_last=True, lengths=lengths)
        return DataLoader(self.train, batch_sampler=batches, collate_fn=padded)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.held_out, batch_size=self.batch_size, collate_fn=padded)

    test_dataloader = predict_dataloader = val_dataloader


class BatchesOfLength(BatchSampler):
    """Batches of samples of about the same length: the sampler's order is cut into pools of 8 batches, each pool
    sorted by length and cut into batches, and the batches are shuffled (by Python's generator)."""

    def __init__(self, sampler: Sampler[int], batch_size: int, drop_last: bool, lengths: Sequence[int]) -> None:
        super().__init__(sampler, batch_size, drop_last)
        self.lengths = lengths

    def __iter__(self) -> Iterator[list[int]]:
        order = list(self.sampler)
        pool = 8 * self.batch_size
        batches = []
        for start in range(0, len(order), pool):
            by_length = sorted(order[start : start + pool], key=self.lengths.__getitem__)
            batches += [by_length[i : i + self.batch_size] for i in range(0, len(by_length), self.batch_size)]
        if self.drop_last and batches and len(batches[-1]) < self.batch_size:
            batches.pop()
        random.shuffle(batches)
        return iter(batches)


def padded(pairs: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Lines of several lengths as one batch: the inputs padded with 0, the targets with -100, which the loss skips."""
    ids, following = zip(*pairs, strict=True)
    return pad_sequence(ids, batch_first=True), pad_sequence(following, batch_first=True, padding_value=-100)


class CharLanguageModel(LightningModule):
    """A GRU that predicts each next character; logs val/loss and val/ppl."""

    def __init__(self, vocab_size: int, hidden: int = 64, lr: float = 3e-3, dropout: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.gru = nn.GRU(hidden, hidden, batch_first=True)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, ids: Tensor) -> Tensor:
        states, _ = self.gru(self.embed(ids))
        return self.head(self.dropout(states))

    def loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        ids, following = batch
        return F.cross_entropy(self(ids).flatten(0, 1), following.flatten())

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss = self.loss(batch)
        self.log_dict({"val/loss": loss, "val/ppl": loss.exp()}, sync_dist=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("test/loss", self.loss(batch), sync_dist=True)

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict[str, Tensor]:
        ids, _ = batch
        return {"next_characters": self(ids).argmax(dim=-1)}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
