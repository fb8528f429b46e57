"""Bad settings in one line: what is wrong and where (the config file and the key), no usage text.

jsonargparse prints about 60 lines of usage before its message, spreads the message over several
lines, and says `<unicode string>` where a YAML file has a syntax error. `OneLineErrorParser` raises
instead of printing, naming the config file a bad value came from; `one_line` turns the error into
the line `main` prints. `--help` still prints the usage.
"""

import os
import re
import traceback

from jsonargparse import ArgumentError, Namespace
from lightning.pytorch.cli import LightningArgumentParser
from pydantic import ValidationError
from yaml import MarkedYAMLError

from trainkit.run.errors import ConfigError
from trainkit.run.extras import missing_extra

PARSER_KEY = re.compile(r'^Parser key "([^"]+)":')
CLASS_NAME = re.compile(r"<class '(?:[\w.]+\.)?(\w+)'>")  # <class 'int'> -> int
NOT_AN_IMPORT_PATH = "Unexpected import path format:"
# Where the researcher's data module and model prepare their data: a file missing there is bad input.
PREPARING = ("prepare_data", "setup")


class OneLineErrorParser(LightningArgumentParser):
    """LightningCLI's parser, raising `ArgumentError` on bad settings; errors in a config file name the file."""

    def __init__(self, *args, exit_on_error: bool = False, allow_abbrev: bool = False, **kwargs) -> None:
        # allow_abbrev: argparse takes `--trainer.max_ep` for `--trainer.max_epochs`, and a typo for another option.
        super().__init__(*args, exit_on_error=exit_on_error, allow_abbrev=allow_abbrev, **kwargs)

    def parse_path(self, path: str | os.PathLike, *args, **kwargs) -> Namespace:
        try:
            config = super().parse_path(path, *args, **kwargs)
            # Also checked on its own, so that an unknown key is reported with the file it is in.
            self.validate(config, skip_required=True)
        except (ArgumentError, KeyError, TypeError) as error:
            raise ArgumentError(None, f"{path}: {one_line(error)}") from None
        return config


def one_line(error: BaseException) -> str:
    """The key an error is about (if any) and its first cause, on one line.

    jsonargparse wraps each reason in the key and the alternatives it tried: a bad `--data.batch_size`
    is a reason under "batch_size" under "data" (the data module's class_path).
    """
    chain = [error]
    while chain[-1].__cause__ is not None:
        chain.append(chain[-1].__cause__)
    keys = dict.fromkeys(key[1] for cause in chain if (key := PARSER_KEY.match(str(cause))))
    reason = _reason(chain[-1])
    return f"{'.'.join(keys)}: {reason}" if keys else reason


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
    """The line to say instead of a traceback when the researcher's data module or model refused its input: a
    ConfigError, or a missing file, raised while it was built (jsonargparse wraps it), or while it prepared its
    data. None for anything else: a failure in their forward keeps its traceback, they need it."""
    building = any(frame.name == "instantiate_classes" for frame in traceback.extract_tb(error.__traceback__))
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, ConfigError):
            return one_line(error)
        if isinstance(cause, FileNotFoundError):
            preparing = any(frame.name in PREPARING for frame in traceback.extract_tb(cause.__traceback__))
            if building or preparing:
                return one_line(error)
        cause = cause.__cause__ or cause.__context__
    return None
