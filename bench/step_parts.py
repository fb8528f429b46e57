"""Where the template's time per training step goes, part by part, on the generated project's real `fit`.

The default `fit` (every callback of the default config, wandb offline, one torch thread per process)
with one more callback, `StepParts`, which wraps the parts of a step in `time.perf_counter` calls:
Lightning's calls of the callbacks' hooks (per hook, and each callback's own hooks apart), the
model's `self.log` and training accuracy, the data loader, the optimizer's update. Only training
steps after a warm-up are counted; validation and the steps that begin an epoch are left out.
Each part's total over the counted steps, divided by their number: milliseconds per step (a part
within another is counted in both). Rank 0 prints the table and writes it to OUT/parts-<N>p.json.

    python bench/step_parts.py [--processes 1] [--steps 300] [--out build/bench/parts]

Compare two versions by running each on its own checkout (the project is generated from this one).
"""

import argparse
import functools
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loops import fetchers
from lightning.pytorch.trainer import call

from benchmark import REUSE_FREED_MEMORY, TEMPLATE, prepare, project_parser

STEP_HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
              "on_before_zero_grad", "on_train_batch_end")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = project_parser(__doc__.splitlines()[0], TEMPLATE / "build" / "bench" / "parts")
    parser.add_argument("--processes", type=int, default=1, help="DDP processes (gloo on the CPU)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps, the warm-up included")
    parser.add_argument("--warmup", type=int, default=20, help="steps left out at the start")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    project, data_dir = prepare(args)
    out = (args.out / f"parts-{args.processes}p.json").resolve()
    run_dir = args.out / f"run-{args.processes}p"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: `ckpt_path: last` would resume an earlier one
    timer = {"class_path": "step_parts.StepParts", "init_args": {"out": str(out), "warmup": args.warmup}}
    command = [
        sys.executable, "train.py", "fit", "--config", "configs/experiment.yaml",
        "--data.data_dir", str(data_dir), "--data.download", "false", "--trainer.accelerator", "cpu",
        "--trainer.devices", str(args.processes), "--trainer.max_steps", str(args.steps),
        "--trainer.max_epochs", "-1", "--trainer.default_root_dir", str(run_dir),
        f"--trainer.callbacks+={json.dumps(timer)}",
    ]  # fmt: skip
    source = os.pathsep.join(
        filter(None, [str(project / "src"), str(Path(__file__).parent), os.environ.get("PYTHONPATH")])
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", WANDB_MODE="offline", PYTHONPATH=source,
               **REUSE_FREED_MEMORY)  # fmt: skip
    log = args.out / f"parts-{args.processes}p.log"
    with log.open("w") as output:
        result = subprocess.run(command, cwd=project, env=env, stdout=output, stderr=subprocess.STDOUT, check=False)
    if result.returncode != 0:
        raise SystemExit(f"the fit failed (exit {result.returncode}):\n{log.read_text()[-3000:]}")
    parts = json.loads(out.read_text())
    print(f"{args.processes} process(es), {parts['steps']} steps counted, median step {parts['median_step_ms']:.2f} ms")
    for name, ms in parts["ms_per_step"].items():
        print(f"  {ms:8.3f} ms  {name}")
    return parts


class StepParts(Callback):
    """The callback (`--trainer.callbacks+=`): times the parts of each counted step; rank 0 writes `out`."""

    def __init__(self, out: str, warmup: int = 20) -> None:
        self.out, self.warmup = Path(out), warmup
        self.seconds: dict[str, float] = defaultdict(float)
        self.counting = False
        self.started = 0  # training steps begun
        self.steps: list[float] = []  # the counted steps' durations, from one step's start to the next's
        self.last_start: float | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._time(call, "_call_callback_hooks", lambda trainer, hook, *a, **k: f"Lightning calls callbacks' {hook}")
        self._time(
            call, "_call_lightning_module_hook", lambda trainer, hook, *a, **k: f"Lightning calls model's {hook}"
        )
        self._time(call, "_call_strategy_hook", lambda trainer, hook, *a, **k: f"Lightning's strategy: {hook}")
        self._time(LightningModule, "log", "model: self.log")
        if hasattr(pl_module, "train_accuracy"):
            self._time(pl_module.train_accuracy, "update", "model: train_accuracy.update")
        self._time(fetchers._PrefetchDataFetcher, "__next__", "data: the next batch (Lightning's fetcher)")
        self._time(importlib.import_module("torch.optim.adam"), "adam", "optimizer: AdamW's update")
        try:  # the kit's agreements between processes, in versions that have them
            agreement = importlib.import_module("trainkit.checkpoints.agreement").Agreement
        except (ImportError, AttributeError):
            return
        self._time(agreement, "propose", "kit: agreement proposed (a gloo all-reduce started)")
        self._time(agreement, "agreed", "kit: agreement read (waited for)")

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for callback in trainer.callbacks:
            for hook in STEP_HOOKS:
                if callback is not self and getattr(type(callback), hook) is not getattr(Callback, hook):
                    self._time(callback, hook, f"callback {type(callback).__name__}.{hook}")

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, index: int) -> None:
        now = time.perf_counter()
        if self.counting and self.last_start is not None:
            self.steps.append(now - self.last_start)
        self.started += 1
        self.counting = self.started > self.warmup and index > 0  # an epoch's first step follows validation
        self.last_start = now if self.counting else None

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.counting, self.last_start = False, None

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.counting = False
        if trainer.global_rank == 0 and self.steps:
            counted = len(self.steps)
            ranked = sorted(self.seconds, key=self.seconds.get, reverse=True)
            self.out.write_text(json.dumps({
                "steps": counted,
                "median_step_ms": statistics.median(self.steps) * 1000,
                "ms_per_step": {name: self.seconds[name] / counted * 1000 for name in ranked},
            }, indent=1))  # fmt: skip

    def _time(self, owner: Any, name: str, label: str | Callable[..., str]) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.counting:
                return original(*args, **kwargs)
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label(*args, **kwargs) if callable(label) else label] += time.perf_counter() - started

        setattr(owner, name, timed)


if __name__ == "__main__":
    main()
