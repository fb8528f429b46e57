"""The local sweep runner: Optuna draws what the sweep file asks for, and the sweep's own command runs each trial."""

import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import torch
import yaml
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from trainkit.run.errors import ConfigError
from trainkit.run.exit_codes import CONFIG_ERROR, PREEMPTED
from trainkit.sweep.local import (
    best_score,
    command,
    distribution_name,
    main,
    new_study,
    next_run_number,
    search_space,
    trial_count,
)

from .helpers import PROJECT_ROOT, clean_env

SWEEP_FILE = PROJECT_ROOT / "configs" / "sweep.yaml"


def drawn(sweep: dict, count: int | None, seed: int | None = None) -> list[dict]:
    """The parameters of a sweep's trials, as the sweep draws them (no trial's score is known)."""
    space = search_space(sweep)
    study = new_study(sweep, space, seed)
    return [study.ask(space).params for _ in range(trial_count(study, count))]


def test_distribution_is_inferred_as_wandb_infers_it():
    assert distribution_name({"value": 3}) == "constant"
    assert distribution_name({"values": [1, 2]}) == "categorical"
    assert distribution_name({"min": 1, "max": 4}) == "int_uniform"
    assert distribution_name({"min": 0.0, "max": 1}) == "uniform"
    assert distribution_name({"distribution": "log_uniform_values", "min": 1e-4, "max": 1e-2}) == "log_uniform_values"
    with pytest.raises(ConfigError, match="cannot tell"):
        distribution_name({"max": 1})


def test_each_wandb_distribution_becomes_optunas():
    parameters = {
        "a": {"value": "fixed"},
        "b": {"values": [32, 64]},
        "c": {"distribution": "uniform", "min": 0.0, "max": 0.5},
        "d": {"distribution": "q_uniform", "min": 0.0, "max": 1.0, "q": 0.25},
        "e": {"min": 1, "max": 3},
        "f": {"distribution": "log_uniform_values", "min": 1e-4, "max": 1e-2},
        "g": {"distribution": "log_uniform", "min": math.log(1e-5), "max": math.log(1e-3)},  # exponents
    }
    space = search_space({"parameters": parameters})
    assert space == {
        "a": CategoricalDistribution(["fixed"]),
        "b": CategoricalDistribution([32, 64]),
        "c": FloatDistribution(0.0, 0.5),
        "d": FloatDistribution(0.0, 1.0, step=0.25),
        "e": IntDistribution(1, 3),
        "f": FloatDistribution(1e-4, 1e-2, log=True),
        "g": FloatDistribution(space["g"].low, space["g"].high, log=True),
    }
    assert (space["g"].low, space["g"].high) == (pytest.approx(1e-5), pytest.approx(1e-3))


def test_random_draws_follow_each_distribution_and_repeat_with_a_seed():
    sweep = {
        "method": "random",
        "parameters": {
            "lr": {"distribution": "log_uniform_values", "min": 1e-4, "max": 1e-2},
            "dropout": {"distribution": "q_uniform", "min": 0.0, "max": 0.5, "q": 0.1},
            "layers": {"min": 1, "max": 3},
            "batch": {"values": [32, 64]},
            "name": {"value": "fixed"},
        },
    }
    runs = drawn(sweep, count=1000, seed=0)
    assert runs == drawn(sweep, count=1000, seed=0)
    assert runs != drawn(sweep, count=1000, seed=1)
    lrs = [run["lr"] for run in runs]
    assert min(lrs) >= 1e-4 and max(lrs) <= 1e-2
    # Log-uniform: half the draws below the geometric midpoint 1e-3 (a plain uniform would put 9% there).
    assert abs(sum(lr < 1e-3 for lr in lrs) / len(lrs) - 0.5) < 0.06
    assert {round(run["dropout"], 6) for run in runs} == {0.0, 0.1, 0.2, 0.3, 0.4, 0.5}
    assert {run["layers"] for run in runs} == {1, 2, 3}
    assert {run["batch"] for run in runs} == {32, 64}
    assert {run["name"] for run in runs} == {"fixed"}


def test_grid_runs_every_combination_in_order():
    sweep = {"method": "grid", "parameters": {"a": {"values": [1, 2]}, "b": {"values": ["x", "y"]}, "c": {"value": 0}}}
    expected = [{"a": a, "b": b, "c": 0} for a in (1, 2) for b in ("x", "y")]
    assert drawn(sweep, count=None) == expected
    assert drawn(sweep, count=3) == expected[:3]
    assert drawn(sweep, count=10) == expected


def test_bayes_learns_from_the_scores_towards_the_metrics_goal():
    sweep = {"method": "bayes", "metric": {"goal": "maximize"}, "parameters": {"x": {"min": 0.0, "max": 1.0}}}
    space = search_space(sweep)
    study = new_study(sweep, space, seed=0)
    assert study.direction == optuna.study.StudyDirection.MAXIMIZE
    for _ in range(40):
        trial = study.ask(space)
        study.tell(trial, trial.params["x"])  # the higher x, the better
    later = [trial.params["x"] for trial in study.trials[20:]]
    assert sum(later) / len(later) > 0.7, "random draws would average 0.5"


@pytest.mark.parametrize(
    ("method", "parameter", "count", "message"),
    [
        ("grid", {"min": 0.1, "max": 1.0}, 2, "grid needs"),
        ("random", {"min": 0.1, "max": 1.0}, None, "give --count"),
        ("random", {"distribution": "normal", "mu": 0, "sigma": 1}, 1, "cannot draw 'normal'"),
        ("random", {"values": ["a", "b"], "probabilities": [0.9, 0.1]}, 1, "probabilities"),
        ("random", {"distribution": "uniform", "max": 1.0}, 1, "p: cannot draw from"),
        ("random", {"min": 1.0, "max": 0.1}, 1, "p: cannot draw from"),
        ("hyperband", {"value": 1}, 1, "method 'hyperband' is not supported"),
    ],
)
def test_sweeps_that_cannot_be_run_locally_are_refused(method, parameter, count, message):
    with pytest.raises(ConfigError, match=message):
        drawn({"method": method, "parameters": {"p": parameter}}, count)
    with pytest.raises(ConfigError, match="metric goal 'maximise'"):
        drawn({"method": "random", "metric": {"goal": "maximise"}, "parameters": {}}, 1)


def test_a_refused_sweep_file_is_one_error_line_and_exit_2(tmp_path, capfd):
    beta, bad_yaml, not_a_sweep = tmp_path / "beta.yaml", tmp_path / "bad.yaml", tmp_path / "string.yaml"
    sweep = {"program": "train.py", "method": "random", "parameters": {"lr": {"distribution": "beta", "a": 1}}}
    beta.write_text(yaml.safe_dump(sweep))
    bad_yaml.write_text("method: [random")
    not_a_sweep.write_text("just a string")
    for sweep_file in (beta, bad_yaml, not_a_sweep, tmp_path / "missing.yaml"):
        assert main([str(sweep_file), "--count", "1", "--root", str(tmp_path / "runs")]) == CONFIG_ERROR
        err = capfd.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"error: {sweep_file}: "), err
    assert not (tmp_path / "runs").exists()
    main([str(beta), "--count", "1"])
    assert "lr: the local sweep cannot draw 'beta', only constant, categorical, uniform" in capfd.readouterr().err


def test_the_sweep_files_command_becomes_a_train_py_command():
    sweep = yaml.safe_load(SWEEP_FILE.read_text())
    assert sweep["metric"] == {"name": "val/acc", "goal": "maximize"}
    params = {"model.dropout": 0.1, "data.batch_size": 64}
    cmd = command(sweep, params, Path("runs/sweep/7"), ["--trainer.max_epochs", "1"])
    assert cmd[:5] == [sys.executable, "train.py", "fit", "--config", "configs/experiment.yaml"]
    # Options after `--` come before the swept values; this run's directory comes after the file's default,
    # and the run keeps its best checkpoint by the sweep's metric, from which its score is read.
    assert cmd[-7:] == [
        "--trainer.max_epochs", "1", "--trainer.default_root_dir=runs/sweep/7",
        "--best_checkpoint.monitor=val/acc", "--best_checkpoint.mode=max",
        "--model.dropout=0.1", "--data.batch_size=64",
    ]  # fmt: skip
    assert cmd.index("--trainer.default_root_dir=runs/sweep") < cmd.index("--trainer.default_root_dir=runs/sweep/7")
    with pytest.raises(ConfigError, match="not supported"):
        command({"program": "train.py", "command": ["${args_json_file}"]}, {}, Path("run"), [])


def test_sweep_runs_go_to_the_wandb_project_of_the_default_experiment():
    sweep = yaml.safe_load(SWEEP_FILE.read_text())
    logger = yaml.safe_load((PROJECT_ROOT / "configs" / "experiment.yaml").read_text())["trainer"]["logger"]
    assert sweep["project"] == logger["init_args"]["project"]
    assert sweep.get("entity") == logger["init_args"].get("entity")


def test_run_numbers_continue_after_earlier_sweeps(tmp_path):
    assert next_run_number(tmp_path / "missing") == 0
    for name in ("0", "1", "5", "notes"):
        (tmp_path / name).mkdir()
    assert next_run_number(tmp_path) == 6


def test_best_score_reads_the_callback_that_monitors_the_metric(tmp_path):
    assert best_score(tmp_path, "val/acc") is None
    callbacks = {
        "ModelCheckpoint{'monitor': 'val/loss'}": {"monitor": "val/loss", "best_model_score": torch.tensor(0.3)},
        "ModelCheckpoint{'monitor': 'val/acc'}": {"monitor": "val/acc", "best_model_score": torch.tensor(0.75)},
    }
    (tmp_path / "checkpoints").mkdir()
    torch.save({"callbacks": callbacks}, tmp_path / "checkpoints" / "last.ckpt")
    assert best_score(tmp_path, "val/acc") == pytest.approx(0.75)
    assert best_score(tmp_path, "train/acc") is None


# A stand-in for train.py (quick: no torch to import): it records its arguments, takes the checkpoint
# saved for its `score` as its last.ckpt, sleeps `sleep` seconds (a SIGTERM ends it with 143, as it ends
# train.py) and exits with `code`.
FAKE_TRAIN = """
import pathlib, shutil, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
args = dict(arg[2:].split('=', 1) for arg in sys.argv[1:] if '=' in arg)
run_dir = pathlib.Path(args['trainer.default_root_dir'])
run_dir.mkdir(parents=True)
(run_dir / 'argv').write_text(' '.join(sys.argv[1:]))
shutil.copy(pathlib.Path(__file__).parent / f"score-{args.get('score', 0)}.ckpt", run_dir / 'last.ckpt')
time.sleep(float(args.get('sleep', 0)))
sys.exit(int(args.get('code', 0)))
"""


def fake_sweep(tmp_path: Path, parameters: dict) -> Path:
    """A grid sweep file that runs FAKE_TRAIN, with a checkpoint for each score it may draw."""
    (tmp_path / "fake_train.py").write_text(FAKE_TRAIN)
    for score in parameters.get("score", {}).get("values", [0]):
        state = {"monitor": "val/acc", "best_model_score": torch.tensor(score)}
        torch.save({"callbacks": {"ModelCheckpoint": state}}, tmp_path / f"score-{score}.ckpt")
    sweep = {"program": str(tmp_path / "fake_train.py"), "method": "grid", "parameters": parameters,
             "metric": {"name": "val/acc", "goal": "maximize"}}  # fmt: skip
    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text(yaml.safe_dump(sweep))
    return sweep_file


def test_failed_runs_are_reported_and_the_sweep_goes_on(tmp_path, capfd, monkeypatch):
    sweep_file = fake_sweep(tmp_path, {"code": {"values": [3, 0]}, "score": {"values": [0.5]}})
    (tmp_path / "runs" / "0").mkdir(parents=True)  # an earlier sweep's run
    monkeypatch.chdir(tmp_path)

    assert main([str(sweep_file), "--root", "runs", "--", "--extra=1"]) == 1
    for number, code in ((1, 3), (2, 0)):
        argv = (tmp_path / "runs" / str(number) / "argv").read_text()
        best = "--best_checkpoint.monitor=val/acc --best_checkpoint.mode=max"
        assert argv == f"--extra=1 --trainer.default_root_dir=runs/{number} {best} --code={code} --score=0.5"
    out = capfd.readouterr().out
    assert "runs/1  failed (exit 3)  code=3 score=0.5" in out
    assert "runs/2  0.5000  code=0 score=0.5" in out
    assert "best: runs/2  val/acc=0.5000" in out


def test_a_run_refused_its_settings_stops_the_sweep_with_exit_2(tmp_path, capfd, monkeypatch):
    """Exit 2 is the sweep's command or parameters, which the next runs share: they would fail the same."""
    sweep_file = fake_sweep(tmp_path, {"code": {"values": [2, 0]}})
    monkeypatch.chdir(tmp_path)
    assert main([str(sweep_file), "--root", "runs"]) == 2
    assert not (tmp_path / "runs" / "1").exists(), "no run starts after one refused its settings"
    error = capfd.readouterr().err.splitlines()[-1]
    assert error == (
        f"error: {sweep_file}: the sweep stopped: runs/0 was refused its settings (its error line is above), as the"
        " next runs would be: fix the sweep's parameters or command"
    )


def test_a_metric_no_run_logged_is_an_error_of_the_sweep_file(tmp_path, capfd, monkeypatch):
    sweep_file = fake_sweep(tmp_path, {"score": {"values": [0.2, 0.9]}})  # the runs log val/acc
    sweep_file.write_text(sweep_file.read_text().replace("name: val/acc", "name: val/mae"))
    monkeypatch.chdir(tmp_path)
    assert main([str(sweep_file), "--root", "runs"]) == 2
    out, err = capfd.readouterr()
    assert "runs/1  n/a  score=0.9" in out and "best:" not in out
    assert err.splitlines()[-1] == (
        f"error: {sweep_file}: no run logged metric.name 'val/mae': set it to a metric the model logs (a run's"
        " `best_checkpoint.monitor:` line above names those its validation logs)"
    )


def test_the_best_run_is_the_one_the_metrics_goal_prefers(tmp_path, capfd, monkeypatch):
    sweep_file = fake_sweep(tmp_path, {"score": {"values": [0.2, 0.9, 0.4]}})
    monkeypatch.chdir(tmp_path)
    assert main([str(sweep_file), "--root", "runs"]) == 0
    assert "best: runs/1  val/acc=0.9000" in capfd.readouterr().out


def test_sigterm_to_the_sweep_stops_the_running_trial_and_the_sweep_with_143(tmp_path):
    sweep_file = fake_sweep(tmp_path, {"sleep": {"values": [60, 0]}})
    sweep = subprocess.Popen(
        [sys.executable, "-m", main.__module__, str(sweep_file), "--root", str(tmp_path / "runs")],
        cwd=PROJECT_ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not (tmp_path / "runs" / "0" / "last.ckpt").exists():  # the first trial is running
        assert time.monotonic() < deadline and sweep.poll() is None, sweep.communicate()[0]
        time.sleep(0.1)
    time.sleep(0.5)
    sweep.send_signal(signal.SIGTERM)  # to the sweep alone: it must pass it on
    out = sweep.communicate(timeout=180)[0]
    assert sweep.returncode == PREEMPTED, out
    assert "failed (exit 143)" in out and "sweep stopped by SIGTERM" in out
    assert not (tmp_path / "runs" / "1").exists(), "no trial starts after the signal"


@pytest.mark.slow
def test_a_local_sweep_trains_each_run_with_its_drawn_values(experiment, tmp_path):
    """`python -m ...sweep <sweep file> --count 2` for real, offline, on the tiny model and data.

    The sweep file is configs/sweep.yaml with the tiny experiment and parameters of the tiny model and data, and a
    metric the experiment's best checkpoint does not follow (it follows val/acc, to be maximized).
    """
    sweep = yaml.safe_load(SWEEP_FILE.read_text())
    sweep["metric"] = {"name": "val/loss", "goal": "minimize"}
    sweep["command"] = [str(experiment) if arg == "configs/experiment.yaml" else arg for arg in sweep["command"]]
    sweep["parameters"] = {
        "model.lr": {"distribution": "log_uniform_values", "min": 0.001, "max": 0.1},
        "model.dropout": {"distribution": "uniform", "min": 0.0, "max": 0.5},
        "data.batch_size": {"values": [16, 32, 64]},
    }
    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text(yaml.safe_dump(sweep))
    root = tmp_path / "sweep"
    quick = [
        "--trainer.accelerator", "cpu", "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "4",
        "--trainer.limit_val_batches", "2", "--trainer.enable_progress_bar", "false",
    ]  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", main.__module__, str(sweep_file), "--count", "2", "--seed", "0",
         "--root", str(root), "--", *quick],
        cwd=PROJECT_ROOT, env=clean_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    scores = []
    for number, params in enumerate(drawn(yaml.safe_load(sweep_file.read_text()), count=2, seed=0)):
        run_dir = root / str(number)
        assert (run_dir / "wandb").is_dir(), "each run logs (offline) into its own directory"
        for name, value in params.items():
            assert config_value(run_dir, name) == pytest.approx(value), name
        score = best_score(run_dir, "val/loss")
        assert score is not None and score > 0.0
        assert f"{run_dir}  {score:.4f}" in result.stdout
        scores.append(score)
    best = min(range(2), key=lambda number: scores[number])
    assert f"best: {root / str(best)}  val/loss={scores[best]:.4f}" in result.stdout


def config_value(run_dir: Path, name: str):
    """The value a command-line name like `data.batch_size` sets in a run's saved config.

    Class sections nest `init_args`.
    """
    section = yaml.safe_load((run_dir / "config.yaml").read_text())
    for key in name.split("."):
        if key not in section and "init_args" in section:
            section = section["init_args"]
        section = section[key]
    return section
