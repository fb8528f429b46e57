"""The example's configs: the experiment and configs/exp/bigger.yaml compose, and MNIST's errors are one line."""

import yaml

from ..conftest import EXPERIMENT, run_train
from .conftest import mnist_run_args


def test_experiment_configs_compose_in_order():
    printed = run_train("fit", "--config", str(EXPERIMENT), "--config", "configs/exp/bigger.yaml", "--print_config")
    assert printed.returncode == 0, printed.stderr[-3000:]
    config = yaml.safe_load(printed.stdout)
    model = config["model"]["init_args"]
    assert model["channels"] == 64 and config["trainer"]["max_epochs"] == 10  # from bigger.yaml
    assert config["data"]["init_args"]["batch_size"] == 256
    assert model["optimizer"]["init_args"] == {**model["optimizer"]["init_args"], "lr": 0.0005}
    assert model["optimizer"]["init_args"]["weight_decay"] == 0.01  # kept from experiment.yaml
    assert model["dropout"] == 0.25  # from configs/model/image_classifier.yaml, which experiment.yaml names
    assert config["seed_everything"] == 42


def test_missing_mnist_files_are_refused_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    result = run_train("fit", *mnist_run_args(tmp_path / "no-data", run_dir))
    assert result.returncode == 2
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and "not found in" in error_lines[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not list(run_dir.rglob("*.ckpt"))
