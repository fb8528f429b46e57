"""The project's model and DataModule in Lightning's own Trainer, with nothing of the kit around them.

The benchmark runs this with the same callback as the template's fit (`interleaved.InterleavedReference`:
the plain PyTorch loop takes turns with its steps), so that what the template adds to a step over plain
PyTorch splits into Lightning's own loop (this run's overhead) and the kit (the template's overhead less
this one). The same model, data, optimizer, scheduler, batch size and seed as the default config; no
logger, no checkpointing, no progress output, no model summary, no command line, no kit callbacks.

    python bench/lightning_alone.py --package PKG --config PROJECT/configs/experiment.yaml --data-dir DATA \
        --devices N --max-steps S --reference '{"out": ..., ...}'
"""

import argparse
import importlib
import json
from functools import partial
from pathlib import Path

import torch
import yaml
from lightning.pytorch import Trainer, seed_everything

from experiment_config import init_args
from interleaved import InterleavedReference


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", required=True, help="the generated project's package (on PYTHONPATH)")
    parser.add_argument("--config", required=True, help="the generated project's configs/experiment.yaml")
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--batch-size", type=int, help="default: the config's data.batch_size")
    parser.add_argument("--reference", required=True, help="InterleavedReference's arguments, as JSON")
    return parser.parse_args()


def with_init_args(config: dict) -> partial:
    """A `{class_path, init_args}` config (the optimizer's, the scheduler's) as the callable LightningCLI makes."""
    module, name = config["class_path"].rsplit(".", 1)
    return partial(getattr(importlib.import_module(module), name), **config.get("init_args", {}))


def main() -> None:
    args = parse_args()
    seed_everything(yaml.safe_load(Path(args.config).read_text())["seed_everything"])
    model_args, data_args = init_args(args.config, "model"), init_args(args.config, "data")
    data_args.update(data_dir=args.data_dir, download=False)
    if args.batch_size is not None:
        data_args["batch_size"] = args.batch_size
    data = importlib.import_module(f"{args.package}.data.mnist").MNISTDataModule(**data_args)
    model_class = importlib.import_module(f"{args.package}.models.image_classifier").ImageClassifier
    optimizer, scheduler = model_args.pop("optimizer"), model_args.pop("scheduler")
    model = model_class(
        in_channels=data.in_channels,
        num_classes=data.num_classes,
        optimizer=with_init_args(optimizer),
        scheduler=with_init_args(scheduler),
        **model_args,
    )
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        precision=args.precision,
        max_steps=args.max_steps,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[InterleavedReference(**json.loads(args.reference))],
    )
    trainer.fit(model, data)
    # Lightning leaves the process group to the interpreter's exit, where gloo's threads may abort the process.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
