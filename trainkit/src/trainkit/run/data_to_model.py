"""What a data module knows of its samples once built, passed on to the model it is trained with.

A model argument named as one of FROM_DATA_TO_MODEL gets the built data module's attribute of that name,
so one model config fits any data (docs/configuration.md). Where either has none, nothing is passed.
"""

import inspect

from jsonargparse import Namespace
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningArgumentParser
from lightning.pytorch.utilities import rank_zero_warn

from trainkit.run.errors import ConfigError

FROM_DATA_TO_MODEL = ("in_channels", "num_classes", "vocab_size", "in_features", "out_features")


def pass_data_to_model(parser: LightningArgumentParser) -> None:
    for name in FROM_DATA_TO_MODEL:
        parser.link_arguments(f"data.{name}", f"model.init_args.{name}", apply_on="instantiate")


def check_what_the_model_got(model: LightningModule, data: LightningDataModule, configured: Namespace) -> None:
    """Refuse a value the model's config gives that the data module's replaced; say which ones it did not give.

    `configured` is the model's config as given, before the data module's attributes were passed on.
    """
    parameters = inspect.signature(type(model).__init__).parameters
    for name in FROM_DATA_TO_MODEL:
        if name not in parameters:
            continue
        default = parameters[name].default
        given = configured.init_args.get(name)
        if not hasattr(data, name):
            if given == default:  # one set only in `setup` comes too late to be passed on
                rank_zero_warn(
                    f"model.{name} is its default, {default!r}: {type(data).__name__} has no {name} once built."
                    f" Set self.{name} in its __init__ to pass it on (one set in setup comes too late), or set"
                    f" model.{name} in the model's config."
                )
        elif given not in (None, default) and given != getattr(data, name):
            raise ConfigError(
                f"model.{name} is {given!r}, but {type(data).__name__} gives {name} {getattr(data, name)!r}, which"
                f" the model gets over its config: leave model.{name} out"
            )
