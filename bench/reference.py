"""The plain PyTorch training loop the template is measured against.

What a researcher writes by hand for the same job: the project's own `ConvNet`, the same real
MNIST files, split, batch size, optimizer, scheduler and seed as the template's default config,
uint8 images kept in memory and normalised per batch, and for several processes the usual
`DistributedDataParallel` script started like torchrun does (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT in the environment). It trains until the timed window is done.

    python bench/reference.py --config PROJECT/configs/mnist.yaml --data-dir DATA --out result.json
"""

import argparse
import importlib
import os
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel
from torchvision.datasets import MNIST

from timing import StepClock


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", required=True, help="the generated project's package (on PYTHONPATH)")
    parser.add_argument("--config", required=True, help="the generated project's configs/mnist.yaml")
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--out", required=True, help="where global rank 0 writes the figures (JSON)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--precision", choices=["32-true", "bf16-mixed"], default="32-true")
    parser.add_argument("--batch-size", type=int, help="default: the config's data.batch_size")
    return parser.parse_args()


def training_split(data_dir: str, val_fraction: float, split_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The template's training part of the MNIST training files: uint8 (N, 1, 28, 28) and int64 labels."""
    dataset = MNIST(data_dir, train=True, download=False)
    order = torch.randperm(len(dataset.targets), generator=torch.Generator().manual_seed(split_seed))
    train_ids = order[int(len(order) * val_fraction) :]
    return dataset.data.unsqueeze(1)[train_ids], dataset.targets[train_ids]


def main() -> None:
    args = parse_args()
    config = yaml.safe_load(Path(args.config).read_text())
    model_config, data_config = config["model"], config["data"]
    optimizer_config, scheduler_config = model_config["optimizer"], model_config["scheduler"]
    if (optimizer_config["class_path"], scheduler_config["class_path"]) != (
        "torch.optim.AdamW",
        "torch.optim.lr_scheduler.StepLR",
    ):
        raise SystemExit("the reference loop implements AdamW + StepLR, the default config's choice")

    ConvNet = importlib.import_module(f"{args.package}.model").ConvNet
    data_module = importlib.import_module(f"{args.package}.data")
    mean, std = data_module.MEAN, data_module.STD

    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.accelerator == "gpu":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")

    torch.manual_seed(config["seed_everything"])
    images, labels = training_split(args.data_dir, data_config["val_fraction"], data_config.get("split_seed", 0))
    model = ConvNet(
        channels=model_config["channels"], hidden=model_config["hidden"], dropout=model_config["dropout"]
    ).to(device)
    if world_size > 1:
        model = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), **optimizer_config["init_args"])
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, **scheduler_config["init_args"])
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16-mixed" else nullcontext()

    clock = StepClock(args.warmup, args.steps, synchronize=torch.cuda.synchronize if device.type == "cuda" else None)
    batch_size, epoch = args.batch_size or data_config["batch_size"], 0
    while not clock.done:
        # Each process takes its own shard of a fresh permutation every epoch, as DistributedSampler does.
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(epoch))
        order = order[: len(order) // world_size * world_size][rank::world_size]  # equal shards
        for ids in order.split(batch_size):
            x = images[ids].to(device, non_blocking=True).float().div_(255).sub_(mean).div_(std)
            y = labels[ids].to(device, non_blocking=True)
            with autocast:
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            clock.tick(epoch, images=len(ids) * world_size)
            if clock.done:
                break
        scheduler.step()
        epoch += 1

    if rank == 0:
        clock.write(args.out)
    if world_size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
