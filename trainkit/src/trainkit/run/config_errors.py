"""Bad settings in one line: what is wrong and where (the config file and the key), no usage text.

jsonargparse prints about 60 lines of usage before its message, spreads the message over several
lines, and says `<unicode string>` where a YAML file has a syntax error. `OneLineErrorParser` raises
instead of printing, naming the config file a bad value came from (`--config`, or a file given for
one key, such as `--model configs/model/x.yaml` or a config's `model: model/x.yaml`); `one_line`
turns the error into the line `main` prints. `--help` still prints the usage.
"""

import os
import re
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

import lightning.pytorch
from jsonargparse import ArgumentError, Namespace
from lightning.pytorch.cli import LightningArgumentParser
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from pydantic import ValidationError
from yaml import MarkedYAMLError, YAMLError, safe_load

from trainkit.run.errors import ConfigError
from trainkit.run.extras import missing_extra
from trainkit.run.researchers_code import raised_in, raised_under_the_researchers_code

PARSER_KEY = re.compile(r'^Parser key "([^"]+)":')
CLASS_NAME = re.compile(r"<class '(?:[\w.]+\.)?(\w+)'>")  # <class 'int'> -> int
NOT_AN_IMPORT_PATH = "Unexpected import path format:"
UNKNOWN_OPTION = re.compile(r"Option '([^']+)' is not accepted")
# Where the researcher's data module and model prepare their data: a file missing there is bad input.
PREPARING = ("prepare_data", "setup")
MAKING_OPTIMIZERS = ("configure_optimizers",)
# Where Lightning checks the trainer's settings against the training loader's length, as a fit starts.
CHECKING_THE_LOADERS = ("setup_data",)
LIGHTNING = Path(lightning.pytorch.__file__).parent  # Lightning's own code
CONFIG_SUFFIXES = (".yaml", ".yml", ".json")


class OneLineErrorParser(LightningArgumentParser):
    """LightningCLI's parser, raising `ArgumentError` on bad settings; an error in a config file names the file, or
    the file given for the key it is about (`--model configs/model/x.yaml`, a config's `model: model/x.yaml`)."""

    def __init__(self, *args, exit_on_error: bool = False, allow_abbrev: bool = False, **kwargs) -> None:
        # allow_abbrev: argparse takes `--trainer.max_ep` for `--trainer.max_epochs`, and a typo for another option.
        super().__init__(*args, exit_on_error=exit_on_error, allow_abbrev=allow_abbrev, **kwargs)

    def parse_args(self, args: Sequence[str] | None = None, *rest, **kwargs) -> Namespace:
        try:
            return super().parse_args(args, *rest, **kwargs)
        except ArgumentError as error:
            given = options_given(sys.argv[1:] if args is None else args)
            key = error_key(error)
            file = None if unknown_option_given(error, key, given) else file_that_set(key, given, Path())
            if file is None:
                raise
            raise ArgumentError(None, f"{file}: {one_line(error)}") from None

    def parse_path(self, path: str | os.PathLike, *args, **kwargs) -> Namespace:
        try:
            config = super().parse_path(path, *args, **kwargs)
            # Also checked on its own, so that an unknown key is reported with the file it is in.
            self.validate(config, skip_required=True)
        except (ArgumentError, KeyError, TypeError) as error:
            file = file_that_set(error_key(error), settings_in(path), Path(path).parent) or path
            raise ArgumentError(None, f"{file}: {one_line(error)}") from None
        return config


def options_given(args: Sequence[str]) -> dict[str, str]:
    """The value given last for each `--key value` (or `--key=value`) in command-line `args`, by key."""
    given = {}
    for position, arg in enumerate(args):
        if arg.startswith("--"):
            option, equals, value = arg[2:].partition("=")
            if not equals and position + 1 < len(args):
                value = args[position + 1]
            given[option] = value
    return given


def settings_in(path: str | os.PathLike) -> dict[str, object]:
    """A config file's settings by dotted key (`model`, `trainer.logger`); none where it cannot be read."""
    try:
        config = safe_load(Path(path).read_text())
    except (OSError, YAMLError):
        return {}

    def flatten(mapping: dict, prefix: str) -> dict[str, object]:
        settings = {}
        for key, value in mapping.items():
            settings[prefix + str(key)] = value
            if isinstance(value, dict):
                settings |= flatten(value, f"{prefix}{key}.")
        return settings

    return flatten(config, "") if isinstance(config, dict) else {}


def unknown_option_given(error: BaseException, key: str | None, given: dict[str, str]) -> bool:
    """Whether the option an error calls unknown was itself given in `given` (`--model.hiden` as well as `--model
    configs/model/x.yaml`): then no file holds it."""
    unknown = UNKNOWN_OPTION.search(_reason(_causes(error)[-1]))
    return bool(unknown and key) and any(
        name.startswith(f"{key}.") and name.endswith(f".{unknown[1]}") for name in given
    )


def file_that_set(key: str | None, given: dict[str, object], base: Path) -> Path | None:
    """The config file (relative to `base`) that `given` names for `key` or the nearest key above it, if any.

    A bad `model.dropout` came from `--model configs/model/x.yaml` unless `--model.dropout` was given too.
    """
    parts = key.split(".") if key else []
    for end in range(len(parts), 0, -1):
        value = given.get(".".join(parts[:end]))
        if value is not None:
            named = isinstance(value, str) and value.endswith(CONFIG_SUFFIXES) and (base / value).is_file()
            return Path(os.path.normpath(base / value)) if named else None
    return None


def error_key(error: BaseException) -> str | None:
    """The dotted key jsonargparse says an error is about (`model.dropout`), None where it names none."""
    keys = _keys(error)
    return ".".join(keys) if keys else None


def one_line(error: BaseException) -> str:
    """The key an error is about (if any) and its first cause, on one line.

    jsonargparse wraps each reason in the key and the alternatives it tried: a bad `--data.batch_size`
    is a reason under "batch_size" under "data" (the data module's class_path).
    """
    keys = _keys(error)
    reason = _reason(_causes(error)[-1])
    return f"{'.'.join(keys)}: {reason}" if keys else reason


def _causes(error: BaseException) -> list[BaseException]:
    chain = [error]
    while chain[-1].__cause__ is not None:
        chain.append(chain[-1].__cause__)
    return chain


def _keys(error: BaseException) -> list[str]:
    return list(dict.fromkeys(key[1] for cause in _causes(error) if (key := PARSER_KEY.match(str(cause)))))


def _reason(error: BaseException) -> str:
    if isinstance(error, MarkedYAMLError) and error.problem_mark is not None:
        # Its own text names the file "<unicode string>": the file is added by `parse_path`.
        mark, context = error.problem_mark, error.context_mark
        reason = f"line {mark.line + 1}, column {mark.column + 1}: {error.problem}"
        return reason + (f" ({error.context} at line {context.line + 1})" if context is not None else "")
    if isinstance(error, ValidationError):  # a limit in a signature, such as PositiveInt
        problem = error.errors()[0]
        return f"{problem['msg'].lower()}, got {problem['input']}"
    message = PARSER_KEY.sub("", str(error))
    install = missing_extra(message)
    if install is not None:  # a class_path whose module imports an optional package that is not installed
        return install
    if message.startswith(NOT_AN_IMPORT_PATH):  # `--data configs/data/x.yaml` where no such file is
        value = message.removeprefix(NOT_AN_IMPORT_PATH).strip()
        if value.endswith((".yaml", ".yml", ".json")) or os.sep in value:
            return f"{value}: no such config file"
    if message.startswith("Unexpected config:"):  # the file is not a mapping: empty, a list or a lone value
        return "holds no settings (a config maps keys such as trainer, model and data to values)"
    return CLASS_NAME.sub(r"\1", " ".join(message.split()))


def mistake_in_the_researchers_code(error: BaseException) -> str | None:
    """The line to say instead of a traceback when the researcher's code refused its input, or Lightning refused how
    the model is set up. None for anything else: a failure in their forward keeps its traceback, they need it.

    - A ConfigError, anywhere.
    - A ValueError Lightning raised checking its settings against the training loader (`val_check_interval`).
    - A ValueError raised while the classes were built (jsonargparse wraps it) or the optimizers made: an option
      out of its range (`noise: -1`, a negative learning rate), with where it was raised.
    - A missing file, raised while the classes were built or the data prepared.
    - A MisconfigurationException: a ReduceLROnPlateau on a metric validation does not log, found at the first
      epoch's end, after last.ckpt is saved.
    """
    causes = [error]
    while (cause := causes[-1].__cause__ or causes[-1].__context__) is not None:
        causes.append(cause)
    building = raised_under(error, ("instantiate_classes",))
    for cause in causes:
        if isinstance(cause, ConfigError):
            return one_line(error)
        if isinstance(cause, MisconfigurationException):  # where the model's code called Lightning, if it did
            under = raised_under_the_researchers_code(cause, Path.cwd())
            return one_line(error) + (f" (in {under[0]}, {under[1]})" if under else "")
        if isinstance(cause, FileNotFoundError) and (building or raised_under(cause, PREPARING)):
            return one_line(error)
    refused = [cause for cause in causes if isinstance(cause, ValueError)]
    if refused and raised_by_lightning_in(refused[-1], CHECKING_THE_LOADERS):  # `val_check_interval` too large
        return f"trainer: {_reason(refused[-1])}"
    if refused and (building or raised_under(refused[-1], MAKING_OPTIMIZERS)):
        function, where = raised_in(refused[-1], Path.cwd())
        return f"{_reason(refused[-1])} (in {function}, {where})"
    return None


def raised_by_lightning_in(error: BaseException, functions: tuple[str, ...]) -> bool:
    """Whether `error` was raised by Lightning's own code, in one of `functions` (not in code they called)."""
    *_, (frame, _) = traceback.walk_tb(error.__traceback__)
    return frame.f_code.co_name in functions and Path(frame.f_code.co_filename).is_relative_to(LIGHTNING)


def raised_under(error: BaseException, functions: tuple[str, ...]) -> bool:
    """Whether `error` was raised inside a call of one of `functions`."""
    return any(frame.name in functions for frame in traceback.extract_tb(error.__traceback__))
