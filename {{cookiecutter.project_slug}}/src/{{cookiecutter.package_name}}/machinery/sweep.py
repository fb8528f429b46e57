"""Run a wandb sweep file on this machine, one run after another, without a wandb server.

    python -m {{ cookiecutter.package_name }}.machinery.sweep configs/sweep.yaml --count 8 [-- more train.py options]

The same file drives `wandb sweep` + `wandb agent`. Here the parameters are drawn the way wandb draws
them for `grid` and `random` sweeps (`bayes` needs the server's record of earlier runs, so it is drawn
at random), each run gets its own `trainer.default_root_dir` (`<root>/<n>`), and the sweep's metric is
read from each run's `last.ckpt`: the best score of the checkpoint callback that monitors it.
Options after `--` go to every run, before the swept values, e.g. `-- --trainer.max_epochs 1`.
A SIGTERM or Ctrl-C stops the running trial as it stops train.py (a checkpoint, exit 143 or 130), then
the sweep, with the same status.
"""

import argparse
import itertools
import math
import pickle
import random
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import torch
import yaml

from .stopping import EXIT_STATUS

Params = dict[str, Any]

# What a wandb agent runs when the sweep file has no `command`.
DEFAULT_COMMAND = ["${env}", "${interpreter}", "${program}", "${args}"]

# How wandb draws a value for each `distribution` of a parameter.
SAMPLERS = {
    "uniform": lambda rng, p: rng.uniform(p["min"], p["max"]),
    "int_uniform": lambda rng, p: rng.randint(p["min"], p["max"]),
    "q_uniform": lambda rng, p: round(rng.uniform(p["min"], p["max"]) / p.get("q", 1)) * p.get("q", 1),
    "log_uniform": lambda rng, p: math.exp(rng.uniform(p["min"], p["max"])),  # min and max are exponents
    "log_uniform_values": lambda rng, p: math.exp(rng.uniform(math.log(p["min"]), math.log(p["max"]))),
    "normal": lambda rng, p: rng.gauss(p.get("mu", 0.0), p.get("sigma", 1.0)),
    "log_normal": lambda rng, p: math.exp(rng.gauss(p.get("mu", 0.0), p.get("sigma", 1.0))),
}


def distribution(spec: dict) -> str:
    """The parameter's distribution, inferred as wandb infers it when the file names none."""
    if "distribution" in spec:
        return spec["distribution"]
    if "value" in spec:
        return "constant"
    if "values" in spec:
        return "categorical"
    if "min" in spec and "max" in spec:
        return "int_uniform" if isinstance(spec["min"], int) and isinstance(spec["max"], int) else "uniform"
    raise ValueError(f"cannot tell how to draw {spec}: give value, values, or min and max")


def draw_one(spec: dict, rng: random.Random) -> Any:
    kind = distribution(spec)
    if kind == "constant":
        return spec["value"]
    if kind == "categorical":
        return rng.choices(spec["values"], weights=spec.get("probabilities"))[0]
    if kind not in SAMPLERS:
        raise ValueError(f"distribution {kind!r} is not supported locally; use one of {sorted(SAMPLERS)}")
    return SAMPLERS[kind](rng, spec)


def draw(sweep: dict, count: int | None, seed: int | None = None) -> list[Params]:
    """The parameters of the first `count` runs; a grid gives every combination when count is None."""
    parameters: dict[str, dict] = sweep["parameters"]
    if sweep.get("method") == "grid":
        choices = []
        for name, spec in parameters.items():
            if distribution(spec) not in ("constant", "categorical"):
                raise ValueError(f"a grid needs `value` or `values` for every parameter; {name} has {spec}")
            choices.append(spec["values"] if "values" in spec else [spec["value"]])
        combinations = itertools.product(*choices)
        return [dict(zip(parameters, values, strict=True)) for values in itertools.islice(combinations, count)]
    if count is None:
        raise ValueError(f"a {sweep.get('method')} sweep never ends by itself: give --count")
    rng = random.Random(seed)
    return [{name: draw_one(spec, rng) for name, spec in parameters.items()} for _ in range(count)]


def command(sweep: dict, params: Params, run_dir: Path, extra: list[str]) -> list[str]:
    """The sweep's `command` with its macros filled in as a wandb agent fills them, plus the run directory."""
    args = [*extra, f"--trainer.default_root_dir={run_dir}"]
    args += [f"--{name}={value}" for name, value in params.items()]  # wandb writes the values with str()
    macros = {
        "${env}": [],  # the agent's `/usr/bin/env` only finds the interpreter: here it is sys.executable
        "${interpreter}": [sys.executable],
        "${program}": [sweep["program"]],
        "${args}": args,
    }
    filled = []
    for part in map(str, sweep.get("command", DEFAULT_COMMAND)):
        if part.startswith("${") and part not in macros:
            raise ValueError(f"{part} is not supported by the local sweep, only {', '.join(macros)}")
        filled += macros.get(part, [part])
    return filled


def best_score(run_dir: Path, metric: str) -> float | None:
    """The best `metric` the run's checkpoint callback saw, from its `last.ckpt`; None if there is none."""
    last = next(run_dir.rglob("last.ckpt"), None)
    if last is None:
        return None
    try:
        checkpoint = torch.load(last, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, pickle.UnpicklingError):
        return None
    for state in checkpoint.get("callbacks", {}).values():
        if isinstance(state, dict) and state.get("monitor") == metric and state.get("best_model_score") is not None:
            return float(state["best_model_score"])
    return None


def next_run_number(root: Path) -> int:
    """Runs are numbered on from earlier sweeps in the same root, so no run resumes or overwrites another."""
    numbers = [int(path.name) for path in root.glob("*") if path.name.isdigit()]
    return max(numbers, default=-1) + 1


class Run(NamedTuple):
    run_dir: Path
    params: Params
    returncode: int
    score: float | None


class PassStopSignalsOn:
    """While the sweep runs, SIGTERM and SIGINT go on to the running trial, which saves and exits, and end the sweep."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self.trial: subprocess.Popen | None = None

    def __enter__(self) -> "PassStopSignalsOn":
        self.previous = {signum: signal.signal(signum, self._pass_on) for signum in EXIT_STATUS}
        return self

    def __exit__(self, *exception: object) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def run(self, cmd: list[str]) -> int:
        """Run a trial to its end (a trial stopped by a signal saves first) and return its exit status."""
        self.trial = subprocess.Popen(cmd)
        if self.received:  # came while it started
            self.trial.send_signal(self.received)
        return self.trial.wait()

    def _pass_on(self, signum: int, frame: object) -> None:
        self.received = signal.Signals(signum)
        if self.trial is not None and self.trial.poll() is None:
            self.trial.send_signal(signum)


def run_sweep(sweep: dict, runs: list[Params], root: Path, extra: list[str]) -> tuple[list[Run], signal.Signals | None]:
    """Run the sweep's command once per parameter set, one after another; a failed run does not stop the rest.

    Returns the runs done and the signal that stopped the sweep, if one did.
    """
    metric = sweep.get("metric", {}).get("name")
    first = next_run_number(root)
    done = []
    with PassStopSignalsOn() as signals:
        for index, params in enumerate(runs):
            if signals.received:
                break
            run_dir = root / str(first + index)
            cmd = command(sweep, params, run_dir, extra)
            print(f"[sweep {index + 1}/{len(runs)}] {shlex.join(cmd)}", flush=True)
            returncode = signals.run(cmd)
            score = best_score(run_dir, metric) if metric and returncode == 0 else None
            done.append(Run(run_dir, params, returncode, score))
    return done, signals.received


def report(runs: list[Run], metric: dict) -> None:
    print(f"\nsweep results ({metric.get('name', 'no metric')}, goal: {metric.get('goal', 'minimize')}):")
    for run in runs:
        outcome = "n/a" if run.score is None else f"{run.score:.4f}"
        if run.returncode:
            outcome = f"failed (exit {run.returncode})"
        print(f"  {run.run_dir}  {outcome}  " + " ".join(f"{name}={value}" for name, value in run.params.items()))
    scored = [run for run in runs if run.score is not None]
    if scored:
        pick = max if metric.get("goal", "minimize") == "maximize" else min  # wandb's default goal is minimize
        best = pick(scored, key=lambda run: run.score)
        print(f"best: {best.run_dir}  {metric['name']}={best.score:.4f}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(
        prog=f"python -m {__package__}.sweep",
        description=__doc__.split("\n")[0],
        epilog="Options after -- go to every run, e.g. -- --trainer.max_epochs 1",
    )
    parser.add_argument("sweep_file", type=Path, help="a wandb sweep file, e.g. configs/sweep.yaml")
    parser.add_argument("--count", type=int, help="number of runs (a grid runs every combination by default)")
    parser.add_argument("--root", type=Path, default=Path("runs/sweep"), help="runs go to ROOT/<n> (%(default)s)")
    parser.add_argument("--seed", type=int, help="seed for drawing the parameters, to repeat a sweep")
    options = parser.parse_args(own)

    sweep = yaml.safe_load(options.sweep_file.read_text())
    try:
        runs = draw(sweep, options.count, options.seed)
        command(sweep, runs[0] if runs else {}, options.root, extra)  # refuse an unsupported command before any run
    except ValueError as error:
        parser.error(str(error))
    done, stopped_by = run_sweep(sweep, runs, options.root, extra)
    report(done, sweep.get("metric", {}))
    if stopped_by:
        print(f"sweep stopped by {stopped_by.name}", flush=True)
        return EXIT_STATUS[stopped_by]
    return 1 if len(done) < len(runs) or any(run.returncode for run in done) else 0


if __name__ == "__main__":
    sys.exit(main())
