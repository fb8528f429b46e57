"""The settings of the generated project's experiment config, as the benchmark's own loops need them.

configs/experiment.yaml names the model's and the data's configs by path (`model: model/image_classifier.yaml`,
relative to the experiment file) where it could also hold them inline; either way the section's
`init_args` are what the plain loop and the loader benchmark build their model and data from.
"""

from pathlib import Path

import yaml


def init_args(config_path: str | Path, section: str) -> dict:
    """`section`'s init_args in the experiment config, read from the file it names when it names one."""
    config_path = Path(config_path)
    value = yaml.safe_load(config_path.read_text())[section]
    if isinstance(value, str):
        value = yaml.safe_load((config_path.parent / value).read_text())
    return value["init_args"]
