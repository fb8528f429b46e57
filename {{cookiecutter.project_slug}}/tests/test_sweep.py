"""The local sweep runner: it draws what the sweep file asks for and runs the sweep's own command."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from {{ cookiecutter.package_name }}.machinery.sweep import best_score, command, distribution, draw, main, next_run_number

from .conftest import PROJECT_ROOT, clean_env

SWEEP_FILE = PROJECT_ROOT / "configs" / "sweep.yaml"


def test_distribution_is_inferred_as_wandb_infers_it():
    assert distribution({"value": 3}) == "constant"
    assert distribution({"values": [1, 2]}) == "categorical"
    assert distribution({"min": 1, "max": 4}) == "int_uniform"
    assert distribution({"min": 0.0, "max": 1}) == "uniform"
    assert distribution({"distribution": "log_uniform_values", "min": 1e-4, "max": 1e-2}) == "log_uniform_values"
    with pytest.raises(ValueError, match="cannot tell"):
        distribution({"max": 1})


def test_random_draws_follow_each_distribution_and_repeat_with_a_seed():
    sweep = {
        "method": "random",
        "parameters": {
            "lr": {"distribution": "log_uniform_values", "min": 1e-4, "max": 1e-2},
            "layers": {"min": 1, "max": 3},
            "batch": {"values": [32, 64]},
            "name": {"value": "fixed"},
        },
    }
    runs = draw(sweep, count=2000, seed=0)
    assert runs == draw(sweep, count=2000, seed=0)
    lrs = [run["lr"] for run in runs]
    assert min(lrs) >= 1e-4 and max(lrs) <= 1e-2
    # Log-uniform: half the draws below the geometric midpoint 1e-3 (a plain uniform would put 9% there).
    assert abs(sum(lr < 1e-3 for lr in lrs) / len(lrs) - 0.5) < 0.05
    assert {run["layers"] for run in runs} == {1, 2, 3}
    assert {run["batch"] for run in runs} == {32, 64}
    assert {run["name"] for run in runs} == {"fixed"}


def test_categorical_probabilities_and_log_uniform_exponents():
    sweep = {
        "parameters": {
            "optimizer": {"values": ["adam", "sgd"], "probabilities": [0.9, 0.1]},
            "wd": {"distribution": "log_uniform", "min": math.log(1e-5), "max": math.log(1e-3)},
        }
    }
    runs = draw(sweep, count=1000, seed=1)
    assert 0.85 < sum(run["optimizer"] == "adam" for run in runs) / len(runs) < 0.95
    assert all(1e-5 <= run["wd"] <= 1e-3 for run in runs)


def test_grid_runs_every_combination_in_order():
    sweep = {"method": "grid", "parameters": {"a": {"values": [1, 2]}, "b": {"values": ["x", "y"]}, "c": {"value": 0}}}
    expected = [{"a": a, "b": b, "c": 0} for a in (1, 2) for b in ("x", "y")]
    assert draw(sweep, count=None) == expected
    assert draw(sweep, count=3) == expected[:3]


def test_sweeps_that_cannot_be_run_locally_are_refused():
    with pytest.raises(ValueError, match="grid needs"):
        draw({"method": "grid", "parameters": {"lr": {"min": 0.1, "max": 1.0}}}, count=2)
    with pytest.raises(ValueError, match="give --count"):
        draw({"method": "random", "parameters": {"lr": {"min": 0.1, "max": 1.0}}}, count=None)
    with pytest.raises(ValueError, match="not supported"):
        draw({"parameters": {"lr": {"distribution": "beta", "a": 1, "b": 2}}}, count=1)
    with pytest.raises(ValueError, match="not supported"):
        command({"program": "train.py", "command": ["${args_json_file}"]}, {}, Path("run"), [])


def test_the_sweep_files_command_becomes_a_train_py_command():
    sweep = yaml.safe_load(SWEEP_FILE.read_text())
    assert sweep["metric"] == {"name": "val/acc", "goal": "maximize"}
    params = {"model.dropout": 0.1, "data.batch_size": 64}
    cmd = command(sweep, params, Path("runs/sweep/7"), ["--trainer.max_epochs", "1"])
    assert cmd[:5] == [sys.executable, "train.py", "fit", "--config", "configs/experiment.yaml"]
    # Options after `--` come before the swept values; this run's directory comes after the file's default.
    assert cmd[-5:] == [
        "--trainer.max_epochs", "1", "--trainer.default_root_dir=runs/sweep/7",
        "--model.dropout=0.1", "--data.batch_size=64",
    ]  # fmt: skip
    assert cmd.index("--trainer.default_root_dir=runs/sweep") < cmd.index("--trainer.default_root_dir=runs/sweep/7")


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


def test_failed_runs_are_reported_and_the_sweep_goes_on(tmp_path, capfd, monkeypatch):
    # A stand-in for train.py that records its arguments and exits with the code it is given.
    program = tmp_path / "fake_train.py"
    program.write_text(
        "import sys, pathlib\n"
        "args = dict(arg[2:].split('=', 1) for arg in sys.argv[1:] if '=' in arg)\n"
        "pathlib.Path(args['trainer.default_root_dir']).mkdir(parents=True)\n"
        "pathlib.Path(args['trainer.default_root_dir'], 'argv').write_text(' '.join(sys.argv[1:]))\n"
        "sys.exit(int(args['code']))\n"
    )
    sweep_file = tmp_path / "sweep.yaml"
    sweep = {"program": str(program), "method": "grid", "parameters": {"code": {"values": [3, 0]}}}
    sweep_file.write_text(yaml.safe_dump(sweep))
    monkeypatch.chdir(tmp_path)

    assert main([str(sweep_file), "--root", "runs", "--", "--extra=1"]) == 1
    assert (tmp_path / "runs" / "0" / "argv").read_text() == "--extra=1 --trainer.default_root_dir=runs/0 --code=3"
    assert (tmp_path / "runs" / "1" / "argv").read_text() == "--extra=1 --trainer.default_root_dir=runs/1 --code=0"
    out = capfd.readouterr().out
    assert "runs/0  failed (exit 3)  code=3" in out
    assert "runs/1  n/a  code=0" in out


@pytest.mark.slow
def test_a_local_sweep_trains_each_run_with_its_drawn_values(mnist_dir, tmp_path):
    """`python -m ...sweep configs/sweep.yaml --count 2` for real, offline, on the small synthetic data."""
    root = tmp_path / "sweep"
    quick = [
        "--data.data_dir", str(mnist_dir), "--data.download", "false", "--trainer.accelerator", "cpu",
        "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "4", "--trainer.limit_val_batches", "2",
        "--trainer.enable_progress_bar", "false",
    ]  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", main.__module__, str(SWEEP_FILE), "--count", "2", "--seed", "0",
         "--root", str(root), "--", *quick],
        cwd=PROJECT_ROOT, env=clean_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    drawn = draw(yaml.safe_load(SWEEP_FILE.read_text()), count=2, seed=0)
    scores = []
    for number, params in enumerate(drawn):
        run_dir = root / str(number)
        assert (run_dir / "wandb").is_dir(), "each run logs (offline) into its own directory"
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
        for name, value in params.items():
            assert config_value(config, name) == pytest.approx(value), name
        score = best_score(run_dir, "val/acc")
        assert score is not None and 0.0 <= score <= 1.0
        assert f"{run_dir}  {score:.4f}" in result.stdout
        scores.append(score)
    best = max(range(2), key=lambda number: scores[number])
    assert f"best: {root / str(best)}  val/acc={scores[best]:.4f}" in result.stdout


def config_value(config: dict, name: str):
    """The value a command-line name like `data.batch_size` sets in a saved config (class sections nest init_args)."""
    section = config
    for key in name.split("."):
        if key not in section and "init_args" in section:
            section = section["init_args"]
        section = section[key]
    return section
