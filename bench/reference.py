"""The plain PyTorch training loop the template is measured against.

What a researcher writes by hand for the same job: the project's own `ConvNet`, the same real
MNIST files, split, batch size, optimizer, scheduler and seed as the template's default config,
uint8 images kept in memory and normalised per batch, and for several processes the usual
`DistributedDataParallel` script started like torchrun does (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT in the environment). It trains until the timed window is done.

`PlainLoop` is that loop, one step at a time, so that `interleaved.py` can also run it in turns
with the template's own steps inside the template's processes.

    python bench/reference.py --config PROJECT/configs/experiment.yaml --data-dir DATA --out result.json
"""

import argparse
import importlib
import itertools
import os
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from torchvision.datasets import MNIST

from experiment_config import init_args
from timing import StepClock, synchronize_on


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", required=True, help="the generated project's package (on PYTHONPATH)")
    parser.add_argument("--config", required=True, help="the generated project's configs/experiment.yaml")
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--out", required=True, help="where global rank 0 writes the figures (JSON)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--precision", choices=["32-true", "bf16-mixed"], default="32-true")
    parser.add_argument("--batch-size", type=int, help="default: the config's data.batch_size")
    return parser.parse_args()


def training_split(data_dir: str, val_fraction: float, split_seed: int) -> tuple[Tensor, Tensor]:
    """The template's training part of the MNIST training files: uint8 (N, 1, 28, 28) and int64 labels."""
    dataset = MNIST(data_dir, train=True, download=False)
    order = torch.randperm(len(dataset.targets), generator=torch.Generator().manual_seed(split_seed))
    train_ids = order[int(len(order) * val_fraction) :]
    return dataset.data.unsqueeze(1)[train_ids], dataset.targets[train_ids]


class PlainLoop:
    """The hand-written loop's state; `step()` trains on the next batch.

    With a process group initialised, the model is wrapped in `DistributedDataParallel` and each
    process trains on its own shard of every epoch.
    """

    def __init__(
        self,
        package: str,
        config_path: str,
        data_dir: str,
        device: torch.device,
        precision: str = "32-true",
        batch_size: int | None = None,
    ) -> None:
        model_config, data_config = init_args(config_path, "model"), init_args(config_path, "data")
        optimizer_config, scheduler_config = model_config["optimizer"], model_config["scheduler"]
        if (optimizer_config["class_path"], scheduler_config["class_path"]) != (
            "torch.optim.AdamW",
            "torch.optim.lr_scheduler.StepLR",
        ):
            raise SystemExit("the reference loop implements AdamW + StepLR, the default config's choice")
        ConvNet = importlib.import_module(f"{package}.models.image_classifier").ConvNet
        data_module = importlib.import_module(f"{package}.data.mnist")
        self.mean, self.std = data_module.MEAN, data_module.STD

        distributed = dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1
        self.device = device
        self.batch_size = batch_size or data_config["batch_size"]
        self.images, self.labels = training_split(
            data_dir, data_config["val_fraction"], data_config.get("split_seed", 0)
        )
        model = ConvNet(
            channels=model_config["channels"], hidden=model_config["hidden"], dropout=model_config["dropout"]
        ).to(device)
        if distributed:
            model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), **optimizer_config["init_args"])
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, **scheduler_config["init_args"])
        bf16 = precision == "bf16-mixed"
        self.autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
        self.epoch = 0
        self._batches = self._epochs()

    def _epochs(self) -> Iterator[Tensor]:
        """The indices of each batch, epoch after epoch; the scheduler steps between epochs."""
        for self.epoch in itertools.count():
            # Each process takes its own shard of a fresh permutation every epoch, as DistributedSampler does.
            order = torch.randperm(len(self.labels), generator=torch.Generator().manual_seed(self.epoch))
            order = order[: len(order) // self.world_size * self.world_size][self.rank :: self.world_size]
            yield from order.split(self.batch_size)
            self.scheduler.step()

    def step(self) -> int:
        """One optimizer step on the next batch; the images it trained on, over all processes."""
        ids = next(self._batches)
        x = self.images[ids].to(self.device, non_blocking=True).float().div_(255).sub_(self.mean).div_(self.std)
        y = self.labels[ids].to(self.device, non_blocking=True)
        with self.autocast:
            loss = F.cross_entropy(self.model(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return len(ids) * self.world_size


def main() -> None:
    args = parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.accelerator == "gpu":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")

    torch.manual_seed(yaml.safe_load(Path(args.config).read_text())["seed_everything"])
    loop = PlainLoop(args.package, args.config, args.data_dir, device, args.precision, args.batch_size)
    clock = StepClock(args.warmup, args.steps, synchronize=synchronize_on(device))
    while not clock.done:
        images = loop.step()
        clock.tick(loop.epoch, images)

    if loop.rank == 0:
        clock.write(args.out)
    if dist.is_initialized():
        # Torn down together, and the DDP model (which holds the group) first: a process that destroyed the group
        # while another still wrote its figures, or with the model still alive, was once ended by std::terminate.
        dist.barrier()
        del loop
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
