"""The generated DataModule's training loader alone, with no model: how many images per second it delivers.

The DataModule is built from the config's `data:` section. Each batch goes through its
`on_after_batch_transfer` (the per-batch normalisation), as in training, so this is the whole
data path a training step waits for.

    python bench/loader.py --package PACKAGE --config PROJECT/configs/mnist.yaml --data-dir DATA --out result.json
"""

import argparse
import importlib
import json
import time
from pathlib import Path

import yaml


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", required=True, help="the generated project's package (on PYTHONPATH)")
    parser.add_argument("--config", required=True, help="the generated project's configs/mnist.yaml")
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch-size", type=int, help="default: the config's data.batch_size")
    parser.add_argument("--seconds", type=float, default=3.0, help="measure for at least this long")
    args = parser.parse_args()

    settings = yaml.safe_load(Path(args.config).read_text())["data"]
    settings.update(data_dir=args.data_dir, download=False)
    if args.batch_size is not None:
        settings["batch_size"] = args.batch_size
    data = importlib.import_module(f"{args.package}.data").MNISTDataModule(**settings)
    data.setup("fit")
    loader = data.train_dataloader()
    for batch in loader:  # warm-up: one epoch
        data.on_after_batch_transfer(batch, dataloader_idx=0)

    images, start = 0, time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        for batch in loader:
            batch = data.on_after_batch_transfer(batch, dataloader_idx=0)
            images += len(batch[0])
    seconds = time.perf_counter() - start
    Path(args.out).write_text(json.dumps({"images_per_s": images / seconds, "images": images}, indent=2))


if __name__ == "__main__":
    main()
