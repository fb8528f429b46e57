"""Run a wandb sweep file on this machine, one trial after another, without a wandb server.

    python -m trainkit.sweep configs/sweep.yaml --count 8 [--seed 0] [-- more train.py options]

The same file drives `wandb sweep` + `wandb agent`. Here Optuna draws the parameters (`random`: its
RandomSampler, `bayes`: its TPESampler, random for the first 10 trials; `grid`: every combination in
order), each trial runs the sweep's command in its own `trainer.default_root_dir` (`<root>/<n>`), and
its score is the best value of the sweep's metric (its best checkpoint follows that metric), read from
the run's `last.ckpt`. Options after `--`
go to every trial. A SIGTERM or Ctrl-C stops the running trial as it stops train.py (a checkpoint,
exit 143 or 130), then the sweep, with the same status.
"""

import argparse
import itertools
import math
import pickle
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
import torch
import yaml
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from trainkit.run.errors import ConfigError
from trainkit.run.exit_codes import CONFIG_ERROR
from trainkit.run.stopping import EXIT_STATUS

# What a wandb agent runs when the sweep file has no `command`.
DEFAULT_COMMAND = ["${env}", "${interpreter}", "${program}", "${args}"]

# Each wandb `distribution` as Optuna's; wandb's others (normal, beta, q_log_*, inv_log_*) Optuna has not.
DISTRIBUTIONS: dict[str, Callable[[dict], BaseDistribution]] = {
    "constant": lambda p: CategoricalDistribution([p["value"]]),
    "categorical": lambda p: CategoricalDistribution(p["values"]),
    "uniform": lambda p: FloatDistribution(p["min"], p["max"]),
    "q_uniform": lambda p: FloatDistribution(p["min"], p["max"], step=p.get("q", 1)),
    "int_uniform": lambda p: IntDistribution(p["min"], p["max"]),
    "log_uniform_values": lambda p: FloatDistribution(p["min"], p["max"], log=True),
    "log_uniform": lambda p: FloatDistribution(math.exp(p["min"]), math.exp(p["max"]), log=True),  # exponents
}


def distribution_name(spec: dict) -> str:
    """The parameter's distribution, inferred as wandb infers it when the file names none."""
    if "distribution" in spec:
        return spec["distribution"]
    if "value" in spec:
        return "constant"
    if "values" in spec:
        return "categorical"
    if "min" in spec and "max" in spec:
        return "int_uniform" if isinstance(spec["min"], int) and isinstance(spec["max"], int) else "uniform"
    raise ConfigError(f"cannot tell how to draw {spec}: give value, values, or min and max")


def search_space(sweep: dict) -> dict[str, BaseDistribution]:
    """The sweep's `parameters` as Optuna distributions, named by their train.py options."""
    space = {}
    for name, spec in sweep.get("parameters", {}).items():
        kind = distribution_name(spec)
        if kind not in DISTRIBUTIONS:
            raise ConfigError(f"{name}: the local sweep cannot draw {kind!r}, only {', '.join(DISTRIBUTIONS)}")
        if "probabilities" in spec:
            raise ConfigError(f"{name}: `probabilities` is not supported locally: the values are drawn evenly")
        try:
            space[name] = DISTRIBUTIONS[kind](spec)
        except (KeyError, TypeError, ValueError) as error:  # a key missing, or limits Optuna refuses
            raise ConfigError(f"{name}: cannot draw from {spec}: {error}") from None
    return space


def new_study(sweep: dict, space: dict[str, BaseDistribution], seed: int | None) -> optuna.Study:
    """An in-memory study that draws as the sweep's `method` asks, towards its metric's `goal`."""
    method, goal = sweep.get("method"), sweep.get("metric", {}).get("goal", "minimize")  # wandb's default goal
    if method not in ("random", "grid", "bayes"):
        raise ConfigError(f"method {method!r} is not supported locally, only random, grid and bayes")
    if goal not in ("minimize", "maximize"):
        raise ConfigError(f"metric goal {goal!r}: give minimize or maximize")
    sampler = optuna.samplers.TPESampler(seed=seed) if method == "bayes" else optuna.samplers.RandomSampler(seed=seed)
    study = optuna.create_study(sampler=sampler, direction=goal)
    if method == "grid":  # every combination, queued in order as wandb runs them
        if not all(isinstance(distribution, CategoricalDistribution) for distribution in space.values()):
            raise ConfigError("a grid needs `value` or `values` for every parameter")
        for values in itertools.product(*(distribution.choices for distribution in space.values())):
            study.enqueue_trial(dict(zip(space, values, strict=True)))
    return study


def trial_count(study: optuna.Study, count: int | None) -> int:
    """How many trials to run: `count`, at most a grid's combinations (all of them by default)."""
    queued = len(study.get_trials(states=[TrialState.WAITING]))
    if queued:
        return queued if count is None else min(count, queued)
    if count is None:
        raise ConfigError("a random or bayes sweep never ends by itself: give --count")
    return count


def command(sweep: dict, params: dict[str, Any], run_dir: Path, extra: list[str]) -> list[str]:
    """The sweep's `command` with its macros filled in as a wandb agent fills them, plus the run directory and,
    where the sweep has a metric, a best checkpoint by it: the trial's score is read from that checkpoint's
    callback, whatever metric the experiment's `best_checkpoint` follows."""
    args = [*extra, f"--trainer.default_root_dir={run_dir}"]
    metric = sweep.get("metric", {})
    if metric.get("name"):
        mode = "max" if metric.get("goal") == "maximize" else "min"
        args += [f"--best_checkpoint.monitor={metric['name']}", f"--best_checkpoint.mode={mode}"]
    args += [f"--{name}={value}" for name, value in params.items()]  # wandb writes the values with str()
    macros = {
        "${env}": [],  # the agent's `/usr/bin/env` only finds the interpreter: here it is sys.executable
        "${interpreter}": [sys.executable],
        "${program}": [sweep.get("program", "")],
        "${args}": args,
    }
    filled = []
    for part in map(str, sweep.get("command", DEFAULT_COMMAND)):
        if part.startswith("${") and part not in macros:
            raise ConfigError(f"{part} is not supported by the local sweep, only {', '.join(macros)}")
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


def run_sweep(
    sweep: dict, study: optuna.Study, space: dict[str, BaseDistribution], count: int, root: Path, extra: list[str]
) -> signal.Signals | None:
    """Run `count` trials one after another; a failed trial does not stop the rest, unless it failed on its settings
    (exit 2: the sweep's command or parameters, which the next trials share). Returns the signal that stopped the
    sweep, if one did. Each trial's run directory and exit status are kept in the study, its score told to it.
    """
    metric = sweep.get("metric", {}).get("name")
    first = next_run_number(root)
    with PassStopSignalsOn() as signals:
        for index in range(count):
            if signals.received:
                break
            trial = study.ask(space)
            run_dir = root / str(first + index)
            cmd = command(sweep, trial.params, run_dir, extra)
            print(f"[sweep {index + 1}/{count}] {shlex.join(cmd)}", flush=True)
            returncode = signals.run(cmd)
            trial.set_user_attr("run_dir", str(run_dir))
            trial.set_user_attr("exit", returncode)
            score = best_score(run_dir, metric) if metric and returncode == 0 else None
            # A trial without a score has nothing to teach the sampler: Optuna calls it failed.
            study.tell(trial, score, state=TrialState.FAIL if score is None else None)
            if returncode == CONFIG_ERROR:
                break
    return signals.received


def report(study: optuna.Study, metric: dict) -> None:
    print(f"\nsweep results ({metric.get('name', 'no metric')}, goal: {study.direction.name.lower()}):")
    for trial in study.get_trials(states=[TrialState.COMPLETE, TrialState.FAIL]):  # not a grid's queued ones
        outcome = "n/a" if trial.value is None else f"{trial.value:.4f}"
        if trial.user_attrs["exit"]:
            outcome = f"failed (exit {trial.user_attrs['exit']})"
        params = " ".join(f"{name}={value}" for name, value in trial.params.items())
        print(f"  {trial.user_attrs['run_dir']}  {outcome}  {params}")
    if study.get_trials(states=[TrialState.COMPLETE]):
        print(f"best: {study.best_trial.user_attrs['run_dir']}  {metric['name']}={study.best_value:.4f}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(
        prog="python -m trainkit.sweep",
        description=__doc__.split("\n")[0],
        epilog="Options after -- go to every run, e.g. -- --trainer.max_epochs 1",
    )
    parser.add_argument("sweep_file", type=Path, help="a wandb sweep file, e.g. configs/sweep.yaml")
    parser.add_argument("--count", type=int, help="number of runs (a grid runs every combination by default)")
    parser.add_argument("--root", type=Path, default=Path("runs/sweep"), help="runs go to ROOT/<n> (%(default)s)")
    parser.add_argument("--seed", type=int, help="seed for drawing the parameters, to repeat a sweep")
    options = parser.parse_args(own)

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the sweep prints each trial itself
    try:
        with options.sweep_file.open() as file:  # YAML's errors then say where in the file, not "<unicode string>"
            sweep = yaml.safe_load(file)
        if not isinstance(sweep, dict):
            raise ConfigError("not a sweep: give program, method, metric and parameters")
        space = search_space(sweep)
        study = new_study(sweep, space, options.seed)
        count = trial_count(study, options.count)
        command(sweep, {}, options.root, extra)  # refuse an unsupported command before any run
    except (OSError, yaml.YAMLError, ConfigError) as error:
        print(f"error: {options.sweep_file}: {' '.join(str(error).split())}", file=sys.stderr)  # YAML's on one line
        return CONFIG_ERROR
    stopped_by = run_sweep(sweep, study, space, count, options.root, extra)
    report(study, sweep.get("metric", {}))
    if stopped_by:
        print(f"sweep stopped by {stopped_by.name}", flush=True)
        return EXIT_STATUS[stopped_by]
    problem = sweep_problem(study, sweep.get("metric", {}).get("name"))
    if problem is not None:
        print(f"error: {options.sweep_file}: {problem}", file=sys.stderr)
        return CONFIG_ERROR
    return 1 if any(trial.user_attrs.get("exit") for trial in study.trials) else 0


def sweep_problem(study: optuna.Study, metric: str | None) -> str | None:
    """What is wrong with the sweep file where its trials show it: a run refused its settings, or none of the runs
    that finished logged the metric. None where neither."""
    ran = [trial for trial in study.trials if "exit" in trial.user_attrs]  # not a grid's queued ones
    last = ran[-1] if ran else None
    if last is not None and last.user_attrs["exit"] == CONFIG_ERROR:
        return (
            f"the sweep stopped: {last.user_attrs['run_dir']} was refused its settings (its error line is above), as"
            " the next runs would be: fix the sweep's parameters or command"
        )
    finished = [trial for trial in ran if trial.user_attrs["exit"] == 0]
    if metric and finished and all(trial.value is None for trial in finished):
        return (
            f"no run logged metric.name {metric!r}: set it to a metric the model logs (a run's"
            " `best_checkpoint.monitor:` line above names those its validation logs)"
        )
    return None


if __name__ == "__main__":
    sys.exit(main())
