"""Your configs, checked without training: the experiment, each config in configs/ on top of it, and a draw of
the sweep's parameters compose and name classes that import. They read configs/, so they check whatever model and
data you put there."""

from pathlib import Path

import pytest
import yaml
from trainkit.sweep.local import new_study, search_space
from trainkit.testing.configs import print_config

from .conftest import EXPERIMENT, PROJECT_ROOT

CONFIGS = PROJECT_ROOT / "configs"
NOT_TRAINING_CONFIGS = {EXPERIMENT, CONFIGS / "sweep.yaml"}  # the experiment itself, and a sweep file


def option_for(config: Path) -> str:
    """How a config is given: a model or data config replaces that section, any other is layered on top."""
    section = config.relative_to(CONFIGS).parts[0]
    return f"--{section}" if section in ("model", "data") else "--config"


OVERLAYS = sorted(path for path in CONFIGS.rglob("*.yaml") if path not in NOT_TRAINING_CONFIGS)


def test_the_experiment_composes():
    assert "model:" in print_config("fit", "--config", str(EXPERIMENT))


@pytest.mark.parametrize("config", OVERLAYS, ids=[str(path.relative_to(CONFIGS)) for path in OVERLAYS])
def test_each_config_composes_with_the_experiment(config):
    assert "model:" in print_config("fit", "--config", str(EXPERIMENT), option_for(config), str(config))


def test_the_sweeps_parameters_are_options_of_the_experiment():
    sweep = yaml.safe_load((CONFIGS / "sweep.yaml").read_text())
    space = search_space(sweep)
    drawn = new_study(sweep, space, seed=0).ask(space).params  # one trial's values, as the local sweep draws them
    options = [f"--{name}={value}" for name, value in drawn.items()]
    assert "model:" in print_config("fit", "--config", str(EXPERIMENT), *options)
