"""How long saving a checkpoint and storing it in an object store take, against preemption grace periods.

A platform that stops a job sends SIGTERM, then SIGKILL after a grace period: 30 s by default on
Kubernetes (`terminationGracePeriodSeconds`), 120 s for an AWS spot instance. On SIGTERM the
generated project writes checkpoints/preempted.ckpt and, with `checkpoint_store.url` set, waits
until the store has it. This measures both parts with the project's own classes, against a real S3
API server (moto's) that it starts on 127.0.0.1, for the example model (the default config's
ImageClassifier) and for a model of about 1 GB (a stack of Linear layers), with and without its
AdamW state:

- the local atomic save: AtomicCheckpointIO.save_checkpoint (torch.save, fsync, rename);
- StoredCheckpointIO.save_checkpoint: the same save and a hard link for the upload to read. This is
  all a periodic checkpoint holds training up for: the upload runs in a background thread;
- StoredCheckpointIO.wait() right after it: the upload (sha256, multipart upload), the `latest`
  pointer's conditional write and the retention's deletions. The save plus this wait is what a
  preempted job spends before it can exit.

moto on 127.0.0.1 measures the client, the server and the local disk, not a network. What a real
bucket adds is mostly the transfer: the table also shows the local save plus the checkpoint's size
at 100 MB/s and at 1 GB/s, computed, not measured. Medians over the repeats; every sample is in
OUT/results.json.

    python bench/checkpoint_store.py [--out build/bench/checkpoint-store] [--repeats 5] [--large-parameters N]
"""

import argparse
import importlib
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import boto3
import lightning
import torch
import torch.nn.functional as F
from torch import nn

from experiment_config import init_args

BENCH = Path(__file__).resolve().parent
TEMPLATE = BENCH.parent

GRACE_PERIODS_S = {"Kubernetes default": 30.0, "AWS spot": 120.0}
BANDWIDTHS = {"100 MB/s": 100e6, "1 GB/s": 1e9}  # bytes per second, for the computed rows
BUCKET = "bench"
TIMED = ("local_save_s", "blocked_s", "upload_s", "sha256_s", "save_and_upload_s")


@dataclass
class Case:
    name: str
    checkpoint: dict[str, Any]  # what Lightning would save, without the global step (set per save)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=TEMPLATE / "build" / "bench" / "checkpoint-store", help="work and result directory"
    )
    parser.add_argument("--project", type=Path, help="an already generated project (default: generate one)")
    parser.add_argument("--package", default="lightning_mnist", help="its package name (with --project)")
    parser.add_argument("--repeats", type=int, default=5, help="saves and uploads of each checkpoint")
    parser.add_argument(
        "--large-parameters",
        type=int,
        default=250_000_000,
        help="parameters of the large model (float32: 4 bytes each; 0 leaves it out)",
    )
    # moto keeps a large object twice on this disk (its parts and the whole): the project's default of 2
    # versions would hold up to 3 x 2 copies of each 1 GB and 3 GB checkpoint at once.
    parser.add_argument(
        "--keep", type=int, default=1, help="versions of each checkpoint the store keeps (checkpoint_store.keep)"
    )
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.large_parameters < 0 or args.keep < 1:
        parser.error("--repeats and --keep must be at least 1, --large-parameters at least 0")
    return args


# ---------------------------------------------------------------- the checkpoints


def lightning_layout(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None) -> dict[str, Any]:
    """What Lightning's checkpoint holds for a model and its optimizer; the loops' and callbacks' state (a few
    kilobytes) is left out."""
    return {
        "epoch": 0,
        "pytorch-lightning_version": lightning.__version__,
        "state_dict": model.state_dict(),
        "optimizer_states": [optimizer.state_dict()],
        "lr_schedulers": [] if scheduler is None else [scheduler.state_dict()],
        "hyper_parameters": dict(getattr(model, "hparams", {})),
    }


def configured(section: dict[str, Any]) -> partial:
    """A `class_path` + `init_args` section of the config as a callable that takes the rest."""
    module, name = section["class_path"].rsplit(".", 1)
    return partial(getattr(importlib.import_module(module), name), **section.get("init_args", {}))


def example_checkpoint(package: str, config: Path) -> dict[str, Any]:
    """The example model with the default config's settings, after one training step (so AdamW has its state)."""
    model_config = init_args(config, "model")
    classifier = importlib.import_module(f"{package}.models.image_classifier").ImageClassifier
    settings = {name: value for name, value in model_config.items() if name not in ("optimizer", "scheduler")}
    scheduler = model_config.get("scheduler")
    model = classifier(
        **settings,
        optimizer=configured(model_config["optimizer"]),
        scheduler=None if scheduler is None else configured(scheduler),
    )
    optimizers = model.configure_optimizers()
    optimizer, scheduler = (optimizers["optimizer"], optimizers["lr_scheduler"]) if scheduler else (optimizers, None)
    batch_size = init_args(config, "data")["batch_size"]
    images, labels = torch.randn(batch_size, 1, 28, 28), torch.randint(0, 10, (batch_size,))  # MNIST's shape
    F.cross_entropy(model(images), labels).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return lightning_layout(model, optimizer, scheduler)


def large_checkpoints(parameters: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A stack of square Linear layers with about `parameters` parameters: its weights alone, and with AdamW's state."""
    width = min(4096, math.isqrt(parameters))
    model = nn.Sequential(
        *(nn.Linear(width, width) for _ in range(max(1, round(parameters / (width * width + width)))))
    )
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(1, width)).square().mean().backward()
    optimizer.step()  # AdamW's two moments per parameter: the checkpoint triples
    optimizer.zero_grad(set_to_none=True)
    with_optimizer = lightning_layout(model, optimizer)
    weights = {name: value for name, value in with_optimizer.items() if name != "optimizer_states"}
    return weights, with_optimizer


def parameters_of(checkpoint: dict[str, Any]) -> int:
    return sum(tensor.numel() for tensor in checkpoint["state_dict"].values())


# ---------------------------------------------------------------- the S3 server


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_s3_server(log: Path) -> tuple[subprocess.Popen, dict[str, str]]:
    """moto's S3 server on 127.0.0.1 with an empty bucket; the AWS_* variables that point boto3 at it."""
    port = free_port()
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    server = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError(f"moto's S3 server did not start:\n{log.read_text()[-3000:]}") from None
            time.sleep(0.1)
    env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
           "AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_CONFIG_FILE": os.devnull}  # fmt: skip
    boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1", aws_access_key_id="bench",
                 aws_secret_access_key="bench").create_bucket(Bucket=BUCKET)  # fmt: skip
    return server, env


# ---------------------------------------------------------------- measuring


class Measurer:
    """Saves each case's checkpoint locally, then saves and stores it, with the generated project's classes."""

    def __init__(self, work: Path, keep: int) -> None:
        self.work = work
        self.keep = keep
        self.stored: dict[str, Any] = {}  # one StoredCheckpointIO per case, as one run has one

    def stored_io(self, case: Case) -> Any:
        if case.name not in self.stored:
            object_store = importlib.import_module("trainkit.store.object_store")
            stored_checkpoints = importlib.import_module("trainkit.checkpoints.stored")
            store = object_store.open_store(f"s3://{BUCKET}/{slug(case.name)}", timeout=60.0)
            io = stored_checkpoints.StoredCheckpointIO(store, keep=self.keep)
            # Untimed: the run's first save also reads the pointer and opens the connections.
            io.save_checkpoint({"global_step": 0}, self.work / slug(case.name) / "stored" / "warm-up.ckpt")
            io.wait()
            self.stored[case.name] = io
        return self.stored[case.name]

    def measure(self, case: Case, step: int) -> dict[str, float]:
        checkpoint = {**case.checkpoint, "global_step": step}
        atomic = importlib.import_module("trainkit.checkpoints.io").AtomicCheckpointIO()
        stored = self.stored_io(case)
        folder = self.work / slug(case.name)
        started = time.perf_counter()
        atomic.save_checkpoint(checkpoint, folder / "local" / "last.ckpt")
        saved = time.perf_counter()
        stored.save_checkpoint(checkpoint, folder / "stored" / "preempted.ckpt")
        returned = time.perf_counter()
        stored.wait()
        done = time.perf_counter()
        # Apart, after the upload: the hash the upload computes first, which a real bucket's upload pays too.
        importlib.import_module("trainkit.checkpoints.stored").sha256_of(folder / "stored" / "preempted.ckpt")
        hashed = time.perf_counter()
        return {
            "bytes": (folder / "stored" / "preempted.ckpt").stat().st_size,
            "local_save_s": saved - started,
            "blocked_s": returned - saved,
            "upload_s": done - returned,
            "sha256_s": hashed - done,
            "save_and_upload_s": done - saved,
        }


def slug(name: str) -> str:
    return "".join(character if character.isalnum() else "-" for character in name.lower()).strip("-")


def summarise(samples: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, Any]]:
    """Medians of each case's samples, the fractions of each grace period, and the computed network times."""
    results = {}
    for name, runs in samples.items():
        figures: dict[str, Any] = {"bytes": runs[0]["bytes"]}
        for field in TIMED:
            figures[field] = statistics.median(run[field] for run in runs)
            figures[f"{field}_range"] = [min(run[field] for run in runs), max(run[field] for run in runs)]
        figures["grace_fraction"] = {
            period: figures["save_and_upload_s"] / seconds for period, seconds in GRACE_PERIODS_S.items()
        }
        figures["computed"] = {}
        for bandwidth, per_s in BANDWIDTHS.items():
            total = figures["blocked_s"] + figures["sha256_s"] + figures["bytes"] / per_s
            fractions = {period: total / seconds for period, seconds in GRACE_PERIODS_S.items()}
            figures["computed"][bandwidth] = {"save_and_transfer_s": total, "grace_fraction": fractions}
        results[name] = figures
    return results


def size_text(size: int) -> str:
    return f"{size / 1e9:.2f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB"


def table(results: dict[str, dict[str, Any]], repeats: int) -> str:
    """The cases side by side: seconds, and the share of each grace period."""
    names = list(results)
    rows: list[tuple[str, list[str]]] = [("checkpoint size", [size_text(results[name]["bytes"]) for name in names])]

    def seconds(label: str, field: str) -> None:
        rows.append((label, [f"{results[name][field]:.2f} s" for name in names]))

    def seconds_and_shares(label: str, value: Any) -> None:
        rows.append((label, [f"{value(results[name]):.2f} s" for name in names]))
        for period, period_s in GRACE_PERIODS_S.items():
            shares = [f"{100 * value(results[name]) / period_s:.1f} %" for name in names]
            rows.append((f"  of {period} ({period_s:.0f} s)", shares))

    seconds("local atomic save (AtomicCheckpointIO)", "local_save_s")
    seconds("periodic save: training held up", "blocked_s")
    seconds("upload + pointer + retention: wait()", "upload_s")
    seconds("  of which the sha256 (timed apart)", "sha256_s")
    seconds_and_shares("preemption: save + wait()", lambda figures: figures["save_and_upload_s"])
    for bandwidth in BANDWIDTHS:
        seconds_and_shares(
            f"computed: save + sha256 + size at {bandwidth}",
            lambda figures, bandwidth=bandwidth: figures["computed"][bandwidth]["save_and_transfer_s"],
        )
    label_width = max(len(label) for label, _ in rows) + 2
    width = max(14, *(len(name) + 2 for name in names))
    lines = [" " * label_width + "".join(f"{name:>{width}}" for name in names)]
    lines += [f"{label:<{label_width}}" + "".join(f"{cell:>{width}}" for cell in cells) for label, cells in rows]
    lines.append(
        f"Medians of {repeats}. Measured against moto's S3 server on 127.0.0.1: the client, the server and this"
        " disk, not a network.\nThe 'computed' rows are not measured: the measured save and sha256 plus the"
        " checkpoint's size over that bandwidth."
    )
    return "\n".join(lines)


# ---------------------------------------------------------------- the whole benchmark


def generated_project(args: argparse.Namespace) -> Path:
    if args.project is not None:
        return args.project.resolve()
    from cookiecutter.main import cookiecutter

    shutil.rmtree(args.out / "project", ignore_errors=True)
    return Path(cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(args.out / "project"))).resolve()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    project = generated_project(args)
    sys.path.insert(0, str(project / "src"))
    work = args.out / "checkpoints"
    shutil.rmtree(work, ignore_errors=True)

    cases = [Case("example model", example_checkpoint(args.package, project / "configs" / "experiment.yaml"))]
    if args.large_parameters:
        weights, with_optimizer = large_checkpoints(args.large_parameters)
        cases += [Case("large: weights", weights), Case("large: weights+AdamW", with_optimizer)]
    server, env = start_s3_server(args.out / "s3-server.log")
    os.environ.update(env)
    samples: dict[str, list[dict[str, float]]] = {case.name: [] for case in cases}
    try:
        measurer = Measurer(work, args.keep)
        for repeat in range(args.repeats):  # the cases take turns, so that the machine's load touches each alike
            print(f"round {repeat + 1}/{args.repeats}", flush=True)
            for case in cases:
                samples[case.name].append(measurer.measure(case, step=repeat + 1))
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(work, ignore_errors=True)
    results = {
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "torch": torch.__version__},
        "parameters": {case.name: parameters_of(case.checkpoint) for case in cases},
        "grace_periods_s": GRACE_PERIODS_S,
        "cases": summarise(samples),
        "samples": samples,
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    if args.large_parameters:
        layers = weights["state_dict"]
        print(
            f"large model: {parameters_of(weights):,} parameters in {len(layers) // 2} float32 Linear layers"
            f" of {tuple(layers['0.weight'].shape)}"
        )
    print(table(results["cases"], args.repeats))
    print(f"every sample: {args.out / 'results.json'}")
    return results


if __name__ == "__main__":
    main()
