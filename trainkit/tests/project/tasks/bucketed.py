"""The tiny images batched by a batch sampler of the data module's own, as language models batch sentences of about
one length: here, images of about one brightness."""

from torch.utils.data import DataLoader, RandomSampler

from trainkit.testing.tiny import TinyDataModule

from .char_lm import BatchesOfLength


class TinyByBrightness(TinyDataModule):
    """TinyDataModule, its training images batched with images of about their brightness (BatchesOfLength)."""

    def train_dataloader(self) -> DataLoader:
        brightness = self.train_set.tensors[0].sum((1, 2, 3)).tolist()
        batches = BatchesOfLength(RandomSampler(self.train_set), self.batch_size, drop_last=False, lengths=brightness)
        return DataLoader(self.train_set, batch_sampler=batches, num_workers=self.num_workers,
                          persistent_workers=self.num_workers > 0)  # fmt: skip
