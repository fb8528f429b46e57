"""The generated DataModule's training loader alone, with no model: how many images per second it delivers.

In memory (default): the DataModule built from the config's `data:` section. Streamed
(`--chunks DIR --workers N`): the streaming DataModule reading the chunks the project's
`chunks` command wrote, with N loader workers that read and decode. Each batch goes through
`on_after_batch_transfer` (the per-batch normalisation), as in training, so this is the whole
data path a training step waits for.

    python bench/loader.py --package PACKAGE --config PROJECT/configs/experiment.yaml --data-dir DATA --out result.json
    python bench/loader.py --package PACKAGE --config ... --chunks CHUNKS --workers 2 --out result.json
"""

import argparse
import importlib
import json
import time
from pathlib import Path

from experiment_config import init_args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", required=True, help="the generated project's package (on PYTHONPATH)")
    parser.add_argument("--config", required=True, help="the generated project's configs/experiment.yaml")
    parser.add_argument("--data-dir", help="MNIST for the in-memory DataModule")
    parser.add_argument("--chunks", help="chunks for the streaming DataModule instead")
    parser.add_argument("--workers", type=int, default=2, help="loader workers when streaming")
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch-size", type=int, help="default: the config's data.batch_size")
    parser.add_argument("--seconds", type=float, default=3.0, help="measure for at least this long")
    args = parser.parse_args()

    batch_size = args.batch_size or init_args(args.config, "data")["batch_size"]
    data = data_module(args, batch_size)
    data.setup("fit")
    loader = data.train_dataloader()
    for batch in loader:  # warm-up: one epoch (and the workers started)
        data.on_after_batch_transfer(batch, dataloader_idx=0)

    images, start = 0, time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        for batch in loader:
            batch = data.on_after_batch_transfer(batch, dataloader_idx=0)
            images += len(batch[0])
    seconds = time.perf_counter() - start
    Path(args.out).write_text(json.dumps({"images_per_s": images / seconds, "images": images}, indent=2))


def data_module(args: argparse.Namespace, batch_size: int):
    if args.chunks:
        from trainkit.data.streaming import StreamingImageDataModule  # the kit's, in the project's src/

        return StreamingImageDataModule(args.chunks, batch_size=batch_size, num_workers=args.workers)
    settings = init_args(args.config, "data")
    settings.update(data_dir=args.data_dir, download=False, batch_size=batch_size)
    return importlib.import_module(f"{args.package}.data.mnist").MNISTDataModule(**settings)


if __name__ == "__main__":
    main()
