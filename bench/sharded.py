"""Sharded training (FSDP2) against DDP, and checkpoints saved in the background against saves that hold training up.

Generates the default project, writes the shipped real MNIST sample, then measures with the
project's real `train.py fit`, 2 processes on CPU (gloo), each case in fresh processes, the cases
taking turns round after round (which goes first alternates), so that the machine's drifting load
touches each alike:

- training throughput of the example model (the default config's ImageClassifier on the MNIST
  sample, every callback of the default config on, as benchmark.py runs it): steps per second
  over steps 11 to 70 (`step_timer.StepTimer`; intervals that cross an epoch boundary, where
  the run validates and checkpoints, are left out), under DDP (the default strategy) and under
  the sharded strategy (`--config configs/strategy/fsdp.yaml`), and sharded/DDP per round;
- checkpoint saves of a model of a few hundred MB (`wide_mlp.WideMLP`, AdamW: the checkpoint is
  three times the weights), under DDP and sharded, each with `checkpoint_saving.asynchronous`
  false and true: `PeriodicCheckpoint` saves every few steps, and the project logs one line per
  save, `checkpoint periodic.ckpt: training waited X s, written in Y s`, which is parsed from the
  run's output. The benchmark's own clock (`wide_mlp.StepEnds`) adds what the project cannot see:
  how much longer a step with a save took than the others, and the training time of the whole
  run, which also holds what a write in the background takes from training on the same cores.

Medians to a table and to build/bench/sharded.json, with every sample; logs in OUT/logs.

    python bench/sharded.py [--out build/bench/sharded] [--repeats 4] [--save-repeats 3] [--parameters 50000000]
"""

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmark import Case, Runner, prepare
from experiment_config import init_args

BENCH = Path(__file__).resolve().parent
TEMPLATE = BENCH.parent

PROCESSES = 2
STRATEGIES = {"DDP": [], "sharded": ["--config", "configs/strategy/fsdp.yaml"]}
SAVINGS = {"sync": "false", "async": "true"}
# The line the project logs for each save (checkpoint_saving.SaveTimes).
SAVE_LINE = re.compile(
    r"checkpoint (?P<name>\S+): training waited (?P<waited>[\d.]+) s, written in (?P<written>[\d.]+) s"
)
# The first steps of a run allocate AdamW's state and warm the allocator: not counted as steady state.
SETTLING_STEPS = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=TEMPLATE / "build" / "bench" / "sharded", help="work directory: project, runs, logs"
    )
    parser.add_argument(
        "--results", type=Path, default=TEMPLATE / "build" / "bench" / "sharded.json", help="where the figures go"
    )
    parser.add_argument("--project", type=Path, help="an already generated project (default: generate one)")
    parser.add_argument("--package", default="lightning_mnist", help="its package name (with --project)")
    parser.add_argument("--data-dir", type=Path, help="MNIST in torchvision's layout (default: the shipped sample)")
    parser.add_argument("--repeats", type=int, default=4, help="rounds of the example model's runs (0: none)")
    parser.add_argument("--warmup", type=int, default=10, help="example model: steps before the timed window")
    parser.add_argument("--steps", type=int, default=60, help="example model: steps timed")
    parser.add_argument("--save-repeats", type=int, default=3, help="rounds of the checkpoint-saving runs (0: none)")
    parser.add_argument(
        "--parameters", type=int, default=50_000_000, help="parameters of the saved model (float32: 4 bytes each)"
    )
    parser.add_argument("--width", type=int, default=2048, help="the saved model's layer width")
    parser.add_argument("--saves", type=int, default=2, help="periodic checkpoints in each saving run")
    parser.add_argument("--every", type=int, default=4, help="steps between two periodic checkpoints")
    parser.add_argument("--save-batch-size", type=int, default=4, help="vectors per process and step, saved model")
    args = parser.parse_args(argv)
    if min(args.repeats, args.save_repeats) < 0 or max(args.repeats, args.save_repeats) < 1:
        parser.error("--repeats and --save-repeats must be 0 or more, and one of them at least 1")
    if min(args.warmup, args.steps, args.parameters, args.width, args.saves, args.every, args.save_batch_size) < 1:
        parser.error("--warmup, --steps, --parameters, --width, --saves, --every, --save-batch-size must be at least 1")
    if args.every <= SETTLING_STEPS:
        parser.error(f"--every must be more than {SETTLING_STEPS}: the steps between saves are the steady state")
    args.batch_size = None  # the example model's runs use the config's batch size (Runner's option)
    args.turn = 1
    return args


class SavingRunner(Runner):
    """benchmark.py's Runner (clean environment, one torch thread per process, malloc settings), plus the runs that
    save the wide model periodically."""

    def saving(self, name: str, strategy: str, saving: str, layers: tuple[int, int]) -> dict[str, Any]:
        args = self.args
        width, depth = layers
        out = self.work / name
        callbacks = [
            {
                "class_path": "trainkit.checkpoints.periodic.PeriodicCheckpoint",
                "init_args": {"every_n_steps": args.every},
            },
            {"class_path": "wide_mlp.StepEnds", "init_args": {"out": str(out)}},
        ]
        command = [
            sys.executable, "train.py", "fit", "--config", "configs/experiment.yaml", *STRATEGIES[strategy],
            "--model", "wide_mlp.WideMLP", "--model.width", str(width), "--model.depth", str(depth),
            "--data", "wide_mlp.RandomVectors", "--data.width", str(width),
            "--data.batch_size", str(args.save_batch_size),
            "--trainer.accelerator", "cpu", "--trainer.devices", str(PROCESSES), "--trainer.logger", "false",
            # Two steps after the last save: its interval ends at the next step, and a write in the background
            # overlaps training as in a longer run.
            "--trainer.max_steps", str(args.saves * args.every + 2), "--trainer.max_epochs", "-1",
            "--trainer.default_root_dir", str(out), "--checkpoint_saving.asynchronous", SAVINGS[saving],
            f"--trainer.callbacks={json.dumps(callbacks)}",
        ]  # fmt: skip
        self._run(name, command, self.env)
        lines = (self.logs / f"{name}.log").read_text().splitlines()
        saves = [match for match in map(SAVE_LINE.search, lines) if match and match["name"] == "periodic.ckpt"]
        if len(saves) != args.saves:
            raise RuntimeError(f"{name}: {len(saves)} save lines in {self.logs / f'{name}.log'}, {args.saves} expected")
        ranks = [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in range(PROCESSES)]
        checkpoint_bytes = sum(file.stat().st_size for file in (out / "checkpoints").rglob("*") if file.is_file())
        shutil.rmtree(out)  # about 3x the weights: a disk filled by the runs would end the benchmark
        return {
            "waited_s": [float(save["waited"]) for save in saves],
            "written_s": [float(save["written"]) for save in saves],
            "checkpoint_bytes": checkpoint_bytes,
            "peak_rss_bytes": [rank["peak_rss_bytes"] for rank in ranks],
            **step_figures(ranks[0]["steps"], ranks[0]["ends"], args.every),
        }


def step_figures(steps: list[int], ends: list[float], every: int) -> dict[str, Any]:
    """From the clock read after each step: the steady steps' rate, the time a save added, the training time.

    Lightning runs checkpoint callbacks after the others, so the clock is read before a step's save: the save
    of step k falls in the interval from the end of step k to the end of step k + 1, with that next step's
    training, slowed by whatever a write in the background takes from it."""
    after = {step: end - start for step, start, end in zip(steps[:-1], ends[:-1], ends[1:], strict=True)}
    typical = statistics.median(
        seconds for step, seconds in after.items() if step > SETTLING_STEPS and step % every != 0
    )
    return {
        "steps_per_s": 1 / typical,
        "save_added_s": [seconds - typical for step, seconds in after.items() if step % every == 0],
        "training_s": ends[-1] - ends[0],  # from the end of the first step to the end of the last
    }


def layers_of(parameters: int, width: int) -> tuple[int, int]:
    """Width and depth of the square Linear stack nearest `parameters`."""
    return width, max(1, round(parameters / (width * width + width)))


# ---------------------------------------------------------------- measuring and summarising


def measure(args: argparse.Namespace, runner: SavingRunner) -> dict[str, list]:
    """Every case once a round; the order reversed every other round."""
    layers = layers_of(args.parameters, args.width)
    samples: dict[str, list] = {"load_average": []}  # the 1-minute load average as each run starts
    throughput_cases = [("example", strategy) for strategy in STRATEGIES]
    saving_cases = [(strategy, saving) for strategy in STRATEGIES for saving in SAVINGS]
    for repeat in range(max(args.repeats, args.save_repeats)):
        print(f"round {repeat + 1}/{max(args.repeats, args.save_repeats)}", flush=True)
        order = 1 if repeat % 2 == 0 else -1
        if repeat < args.repeats:
            for _, strategy in throughput_cases[::order]:
                samples["load_average"].append(os.getloadavg()[0])
                name = f"example-{strategy}-{repeat}"
                run = runner.template(name, Case(strategy, PROCESSES), STRATEGIES[strategy])
                samples.setdefault(f"example: {strategy}", []).append(run)
        if repeat < args.save_repeats:
            for strategy, saving in saving_cases[::order]:
                samples["load_average"].append(os.getloadavg()[0])
                run = runner.saving(f"saving-{strategy}-{saving}-{repeat}", strategy, saving, layers)
                samples.setdefault(f"saving: {strategy} {saving}", []).append(run)
    return samples


def median_range(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "range": [min(values), max(values)]}


def paired_ratio(numerators: list[float], denominators: list[float]) -> dict[str, Any]:
    """Medians of ratios of runs of the same round."""
    return median_range([a / b for a, b in zip(numerators, denominators, strict=True)])


def summarise(samples: dict[str, list], args: argparse.Namespace, batch_size: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    if args.repeats:
        images_per_step = batch_size * PROCESSES
        rates = {
            strategy: [run["images_per_s"] / images_per_step for run in samples[f"example: {strategy}"]]
            for strategy in STRATEGIES
        }
        results["example"] = {
            "batch_size_per_process": batch_size,
            "steps_per_s": {strategy: median_range(values) for strategy, values in rates.items()},
            "sharded_vs_ddp": paired_ratio(rates["sharded"], rates["DDP"]),
        }
    if args.save_repeats:
        cases = {}
        for strategy in STRATEGIES:
            for saving in SAVINGS:
                runs = samples[f"saving: {strategy} {saving}"]
                cases[f"{strategy} {saving}"] = {
                    "checkpoint_bytes": statistics.median(run["checkpoint_bytes"] for run in runs),
                    "peak_rss_bytes": max(sum(run["peak_rss_bytes"]) for run in runs),
                    **{
                        field: median_range([value for run in runs for value in run[field]])
                        for field in ("waited_s", "written_s", "save_added_s")
                    },
                    **{field: median_range([run[field] for run in runs]) for field in ("steps_per_s", "training_s")},
                }
        ratios = {}
        for strategy in STRATEGIES:
            sync, background = samples[f"saving: {strategy} sync"], samples[f"saving: {strategy} async"]
            ratios[f"{strategy} async/sync, training waited"] = paired_ratio(
                [statistics.median(run["waited_s"]) for run in background],
                [statistics.median(run["waited_s"]) for run in sync],
            )
            ratios[f"{strategy} async/sync, training time"] = paired_ratio(
                [run["training_s"] for run in background], [run["training_s"] for run in sync]
            )
        ratios["sharded/DDP steps/s (sync runs)"] = paired_ratio(
            [run["steps_per_s"] for run in samples["saving: sharded sync"]],
            [run["steps_per_s"] for run in samples["saving: DDP sync"]],
        )
        width, depth = layers_of(args.parameters, args.width)
        results["saving"] = {
            "model": {"width": width, "depth": depth, "parameters": depth * (width * width + width)},
            "saves_per_run": args.saves,
            "every_n_steps": args.every,
            "batch_size_per_process": args.save_batch_size,
            "cases": cases,
            "ratios": ratios,
        }
    return results


# ---------------------------------------------------------------- the table


def median_text(figures: dict[str, Any]) -> str:
    low, high = figures["range"]
    return f"{figures['median']:.2f} ({low:.2f}-{high:.2f})"


def table(results: dict[str, Any], args: argparse.Namespace) -> str:
    machine = results["machine"]
    load = machine["load_average"]
    lines = [
        f"CPU ({machine['cpus']} CPUs), {PROCESSES} processes over gloo, one torch thread each,"
        f" torch {machine['torch']}; load average (1 min) as the runs started: {load['median']:.1f}"
        f" ({load['range'][0]:.1f}-{load['range'][1]:.1f})"
    ]
    if "example" in results:
        example = results["example"]
        lines += [
            "",
            f"Example model (ImageClassifier, MNIST sample), batch {example['batch_size_per_process']} per process,"
            f" steps {args.warmup + 1} to {args.warmup + args.steps}; medians of {args.repeats} rounds"
            " (lowest-highest)",
            f"{'':<26}{'steps/s':>22}",
        ]
        for strategy, figures in example["steps_per_s"].items():
            lines.append(f"{strategy:<26}{median_text(figures):>22}")
        lines.append(f"{'sharded/DDP (per round)':<26}{median_text(example['sharded_vs_ddp']):>22}")
    if "saving" in results:
        saving = results["saving"]
        model, cases = saving["model"], saving["cases"]
        size = statistics.median(case["checkpoint_bytes"] for case in cases.values())
        names = list(cases)
        width = max(22, *(len(name) + 2 for name in names))
        label = 40
        rows = [
            ("training waited, per save (s)", "waited_s"),
            ("written in, per save (s)", "written_s"),
            ("a save added to its step (s)", "save_added_s"),
            ("training time of the run (s)", "training_s"),
            ("steps/s between saves", "steps_per_s"),
        ]
        lines += [
            "",
            f"Checkpoint saves: {model['depth']} x Linear({model['width']}, {model['width']}), {model['parameters']:,}"
            f" parameters ({4 * model['parameters'] / 1e6:.0f} MB), AdamW: checkpoint {size / 1e6:.0f} MB;",
            f"{saving['saves_per_run']} periodic saves a run, every {saving['every_n_steps']} steps,"
            f" batch {saving['batch_size_per_process']} per process; medians of {args.save_repeats} rounds"
            " (of every save for the per-save rows; lowest-highest)",
            " " * label + "".join(f"{name:>{width}}" for name in names),
        ]
        for title, field in rows:
            lines.append(f"{title:<{label}}" + "".join(f"{median_text(cases[name][field]):>{width}}" for name in names))
        peaks = "".join(f"{case['peak_rss_bytes'] / 1e9:>{width - 3}.1f} GB" for case in cases.values())
        lines.append(f"{'peak memory, both processes':<{label}}{peaks}")
        lines.append("")
        for name, figures in saving["ratios"].items():
            lines.append(f"{name:<{label}}{median_text(figures):>{width}}")
    lines += [
        "",
        "training waited, written in: the project's own line for each save (checkpoint_saving.SaveTimes);",
        "  written in, async: DDP counts the write in the background, the sharded strategy from the save's start to"
        " its commit.",
        "a save added to its step: the interval holding a save (it and the next step) less a typical step; training"
        " time: from",
        "  the end of step 1 to the end of the last. Both from the benchmark's clock, which also sees what a write in"
        " the",
        "  background takes from training. Ratios: per round, then the median of those.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    args.out = args.out.resolve()
    project, data_dir = prepare(args)
    batch_size = init_args(project / "configs" / "experiment.yaml", "data")["batch_size"]
    runner = SavingRunner(args, project, data_dir, "cpu")
    started = time.monotonic()
    samples = measure(args, runner)
    results = {
        "machine": {
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "load_average": median_range(samples["load_average"]),
        },
        **summarise(samples, args, batch_size),
        "benchmark_seconds": time.monotonic() - started,
        "samples": samples,
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(results, indent=1))
    print(table(results, args))
    print(f"\nfigures: {args.results}; logs: {runner.logs}")
    return results


if __name__ == "__main__":
    main()
