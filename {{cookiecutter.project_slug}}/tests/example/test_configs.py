"""The example's configs: the experiment and configs/exp/bigger.yaml compose in order."""

import yaml
from trainkit.testing.configs import print_config

from ..conftest import PROJECT_ROOT
from .conftest import THE_EXAMPLE


def test_experiment_configs_compose_in_order():
    bigger = PROJECT_ROOT / "configs" / "exp" / "bigger.yaml"
    config = yaml.safe_load(print_config("fit", *THE_EXAMPLE, "--config", str(bigger)))
    model = config["model"]["init_args"]
    assert model["channels"] == 64 and config["trainer"]["max_epochs"] == 10  # from bigger.yaml
    assert config["data"]["init_args"]["batch_size"] == 256
    assert config["data"]["init_args"]["val_fraction"] == 0.1  # kept from configs/data/mnist.yaml
    assert model["optimizer"]["init_args"] == {**model["optimizer"]["init_args"], "lr": 0.0005}
    assert model["optimizer"]["init_args"]["weight_decay"] == 0.01  # kept from configs/model/image_classifier.yaml
    assert model["dropout"] == 0.25  # from there too
    assert config["seed_everything"] == 42
