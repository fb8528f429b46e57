"""Images streamed from litdata chunks: the data path for datasets bigger than memory.

    python -m trainkit.chunks --config configs/experiment.yaml --out data/mnist-chunks
    python train.py fit --config configs/experiment.yaml --data configs/data/streaming_images.yaml

The chunks (of any image data module, written by trainkit/chunks.py) may lie in a local folder,
on a shared file system or in an object store (`s3://...`, `gs://...`; litdata caches what it
reads). Their `info/` says how many channels and classes the images have (the model is built
for them) and how to normalise them. Every process reads its own share of the chunks and every
loader worker a share of that, so each sample is seen once per epoch (but for the last few, when
they do not fill a batch of every worker); the workers decode the images, and the batches become
normalised floats on the device. The training loader resumes mid-epoch, like the in-memory one
(trainkit/data/resumable.py), on another number of processes too: every sample left of the epoch once.
"""

import io
import json
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import LightningDataModule, Trainer
from litdata import StreamingDataLoader, StreamingDataset
from litdata.streaming.elastic import lockstep_stream_from_worker_seqs, sample_in_epoch_from_state
from litdata.utilities.env import _DistributedEnv
from PIL import Image
from pydantic import NonNegativeInt, PositiveInt
from torch import Tensor
from torch.utils.data import DataLoader, Subset
from torchvision.transforms.v2.functional import pil_to_tensor

from trainkit.data.resumable import batches_trained, count_batches_from
from trainkit.data.samplers import say_resharded
from trainkit.run.errors import ConfigError

# litdata gives every loader worker its own share of the samples, so the length it reports is exact.
warnings.filterwarnings("ignore", message="Your `IterableDataset` has `__len__` defined")


class EncodedImages(StreamingDataset):
    """The samples trainkit/chunks.py wrote, decoded: a uint8 image (channels, height, width) and its label."""

    def __getitem__(self, index: Any) -> tuple[Tensor, int]:
        sample = super().__getitem__(index)
        return pil_to_tensor(Image.open(io.BytesIO(sample["image"]))), sample["label"]


def epoch_order(dataset: StreamingDataset, place: dict[str, Any]) -> list[int]:
    """The samples of the epoch litdata's state `place` is in, in the order the job that began it trains on them.

    litdata's shuffler shares the epoch's chunks out over the loader workers of every process (in a way that
    depends on how many there are); each process's loader takes a batch from its workers in turn, and the
    processes train on their batches in step. litdata's own elastic resume rebuilds the same order.
    """
    # The shuffler takes the processes and nodes as litdata's _DistributedEnv, which has no public counterpart.
    layout = _DistributedEnv(place["initial_world_size"], 0, place["initial_num_nodes"])
    workers, batch_size, epoch = place["initial_num_workers"], place["initial_batch_size"], place["current_epoch"]
    len(dataset)  # makes its shuffler, if nothing has asked for its length yet
    shuffler, chunks = dataset.shuffler, len(dataset.shuffler.cache.get_chunk_intervals())
    workers_chunks, workers_intervals = shuffler.get_chunks_and_intervals_per_workers(
        layout, workers, batch_size, epoch
    )
    workers_samples = [
        [sample for chunk, interval in zip(worker_chunks, intervals, strict=True)
         for sample in shuffler(np.arange(interval[1], interval[2]), chunks, epoch, chunk)]
        for worker_chunks, intervals in zip(workers_chunks, workers_intervals, strict=True)
    ]  # fmt: skip
    return lockstep_stream_from_worker_seqs(
        workers_samples, world_size=layout.world_size, num_workers=workers, batch_size=batch_size
    )


@dataclass
class RestOfEpoch:
    """This process's share of the rest of an epoch begun on another layout of processes, workers and batches."""

    epoch: int  # the Trainer's
    place: dict[str, Any]  # litdata's state: where the job stood in the epoch when this run went on with it
    samples: list[int]  # this process's share, in order
    first_batch: int  # where the Trainer's count of the epoch's batches stood when this run went on with it


class ResumableStreamingDataLoader(StreamingDataLoader):
    """litdata's loader, whose own state Lightning keeps in checkpoints, with three additions.

    A new epoch takes its number from the Trainer when its first batch is asked for, so that a
    run resumed at an epoch's end shuffles as the uninterrupted one would; litdata would count
    its epochs from 1 in every run. After an epoch's last batch there is nothing to resume.

    On another number of processes (or workers, or another batch size) litdata would go on with the
    epoch in whole batches of every process and worker, from a place rounded down to one: some
    samples twice, the last few left out. This loader goes on with the rest itself instead, as the
    in-memory one does: the rest of the epoch's order (the job's, from its seed and epoch) with
    process r of R taking its places r, r + R, ... (from the order's start again, to give every process
    as many), read by index. The epoch after it is litdata's again.
    """

    def __init__(self, *args: Any, trainer: Trainer | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trainer = trainer
        self.rest: RestOfEpoch | None = None

    def __iter__(self) -> Any:
        if self.rest is not None and self.rest.epoch == self.trainer.current_epoch:
            yield from DataLoader(
                Subset(self.dataset, self.rest.samples), batch_size=self.batch_size, num_workers=self.num_workers,
                collate_fn=self.collate_fn, pin_memory=self.pin_memory, generator=self.generator,
            )  # fmt: skip
            return
        self.rest = None
        if not self.restore and self.trainer is not None:  # a new epoch, not the rest of a resumed one
            self.current_epoch = self.trainer.current_epoch  # litdata adds one as the epoch starts
        yield from super().__iter__()

    def state_dict(self) -> dict[str, Any]:
        batches = batches_trained(self.trainer)
        if batches is None:
            return {}
        if self.rest is None:
            return super().state_dict()
        # The job's place in the epoch's order: every process has trained on as many whole batches since this run began.
        trained = sample_in_epoch_from_state(self.rest.place)
        trained += (batches - self.rest.first_batch) * self.batch_size * self.trainer.world_size
        place = {
            **self.rest.place, "sample_in_epoch": trained, "num_samples_yielded": 0,
            "world_size": self.trainer.world_size, "num_workers": max(self.num_workers, 1),
            "batch_size": self.batch_size,
            "resume_mode": "elastic",  # litdata's mark for a place in the job's order, not in its order for a layout
        }  # fmt: skip
        return {"dataset": place, "current_epoch": place["current_epoch"], "num_samples_yielded": 0,
                "latest_worker_idx": 0}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        place, processes = state["dataset"], self.trainer.world_size
        layout = (place["world_size"], place["num_workers"], place["batch_size"])
        # A place in litdata's own order for this layout, which it goes on with exactly ("elastic": in the job's order).
        if layout == (processes, max(self.num_workers, 1), self.batch_size) and place.get("resume_mode") != "elastic":
            super().load_state_dict(state)
            return
        order, trained = epoch_order(self.dataset, place), sample_in_epoch_from_state(place)
        left = len(order) - trained
        rest = order[trained:] + order[: -left % processes]  # from the start again: every process takes as many
        # No more batches than the epoch has on this layout (litdata's length), which the rest rarely exceeds.
        batches = min(math.ceil(len(rest) // processes / self.batch_size), len(self))
        rest = rest[: batches * self.batch_size * processes]
        self.rest = RestOfEpoch(self.trainer.current_epoch, place, rest[self.trainer.global_rank :: processes],
                                first_batch=len(self) - batches)  # fmt: skip
        count_batches_from(self.trainer, self.rest.first_batch)
        if place["world_size"] != processes:
            again, left_out = max(0, len(rest) - left), max(0, left - len(rest))
            say_resharded(place["world_size"], processes, left=left - left_out, again=again, left_out=left_out)


def check_chunks(folder: str) -> None:
    """Refuse a local chunk folder that is missing, empty or damaged, naming it (remote ones litdata checks)."""
    if "://" in folder:
        return
    path = Path(folder).resolve()
    convert = "write it with: python -m trainkit.chunks"
    if not path.is_dir():
        raise ConfigError(f"chunk folder {path} does not exist; {convert}")
    try:
        index = json.loads((path / "index.json").read_text())
    except FileNotFoundError:
        raise ConfigError(f"chunk folder {path} has no index.json (empty or unfinished); {convert}") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"chunk folder {path}: index.json is damaged ({error}); {convert}") from None
    for chunk in index.get("chunks", []):
        file = path / chunk["filename"]
        size = file.stat().st_size if file.is_file() else None
        if size != chunk["chunk_bytes"]:
            found = "missing" if size is None else f"{size} bytes instead of {chunk['chunk_bytes']}"
            raise ConfigError(f"chunk folder {path}: {chunk['filename']} is {found}; {convert}")


def chunk_info(input_dir: str) -> dict[str, Any]:
    """What trainkit/chunks.py found out about the images: in_channels, num_classes, per-channel mean and std."""
    check_chunks(f"{input_dir}/info")
    return json.loads(StreamingDataset(f"{input_dir}/info")[0])


class StreamingImageDataModule(LightningDataModule):
    """Train/val/test images from the chunk folders trainkit/chunks.py writes.

    Args:
        input_dir: the folder or URL holding `info/`, `train/`, `val/` and `test/`.
        batch_size: images per batch on each process.
        num_workers: loader worker processes per training process; they read and decode.
        max_cache_size: how much of a remote dataset litdata keeps on local disk.
    """

    def __init__(
        self, input_dir: str = "data/mnist-chunks", batch_size: PositiveInt = 128, num_workers: NonNegativeInt = 2,
        max_cache_size: str = "10GB",
    ) -> None:  # fmt: skip
        super().__init__()
        self.save_hyperparameters()
        self.input_dir = input_dir.rstrip("/")
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.max_cache_size = max_cache_size
        # What the model needs to know, read before setup: the command line passes it on to the model.
        info = chunk_info(self.input_dir)
        self.in_channels, self.num_classes = info["in_channels"], info["num_classes"]
        self.mean, self.std = torch.tensor(info["mean"]), torch.tensor(info["std"])

    def setup(self, stage: str) -> None:
        splits = ("train", "val") if stage == "fit" else ("val",) if stage == "validate" else ("test",)
        for split in splits:
            check_chunks(f"{self.input_dir}/{split}")
        # The order's seed is seed_everything's, as for the in-memory loaders.
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        if "train" in splits:
            # Whole batches on one process too (litdata's default on several), so that a job can go on
            # with an epoch on another number of processes: litdata refuses a checkpoint that differs.
            self.train_set = self._dataset("train", shuffle=True, seed=seed, drop_last=True)
        if "val" in splits:
            self.val_set = self._dataset("val", drop_last=False)
        if "test" in splits:
            self.test_set = self._dataset("test", drop_last=False)

    def train_dataloader(self) -> StreamingDataLoader:
        return ResumableStreamingDataLoader(self.train_set, trainer=self.trainer, **self._loader_options())

    def val_dataloader(self) -> StreamingDataLoader:
        return StreamingDataLoader(self.val_set, **self._loader_options())

    def test_dataloader(self) -> StreamingDataLoader:
        return StreamingDataLoader(self.test_set, **self._loader_options())

    def predict_dataloader(self) -> StreamingDataLoader:
        return self.test_dataloader()

    def on_after_batch_transfer(self, batch: tuple[Tensor, Tensor], dataloader_idx: int) -> tuple[Tensor, Tensor]:
        images, labels = batch
        if self.mean.device != images.device:  # moved once: a copy from CPU memory at every batch waits for the GPU
            self.mean, self.std = self.mean.to(images.device), self.std.to(images.device)
        mean, std = self.mean.view(1, -1, 1, 1), self.std.view(1, -1, 1, 1)
        return images.float().div_(255).sub_(mean).div_(std), labels

    def _dataset(self, split: str, **options: Any) -> EncodedImages:
        return EncodedImages(f"{self.input_dir}/{split}", max_cache_size=self.max_cache_size, **options)

    def _loader_options(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "num_workers": self.num_workers,
            "persistent_workers": self.num_workers > 0,
            "pin_memory": self.trainer is not None and self.trainer.strategy.root_device.type == "cuda",
            # Worker seeds from a generator of its own: torch's global one is the model's.
            "generator": torch.Generator(),
        }
