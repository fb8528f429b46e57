"""A model or data module of another class, named after one is set, replaces it whole.

`--config configs/experiment.yaml --model configs/model/mine.yaml`: jsonargparse gives the new class every
option of the one it replaces that it also takes (the example's scheduler, its `hidden`...), and says nothing.
Before an option or a config that names another class for `model` or `data`, the kit puts `--model null`
(`--data null`), so the class named starts from its own defaults and what its config gives. Options given in
parts (`--model.hidden 64`, a config's `model:` with no class_path) and a class named again still add to what
is set, as jsonargparse adds them.
"""

from pathlib import Path

import yaml

REPLACED_WHOLE = ("model", "data")
OPTIONS = {"--model": "model", "--data": "data", "--config": "config", "-c": "config"}


def replace_whole(args: list[str]) -> list[str]:
    """`args` with `--model null` (`--data null`) put before each option or config that names another class."""
    in_force: dict[str, str | None] = dict.fromkeys(REPLACED_WHOLE)
    replaced = []
    for position, arg in enumerate(args):
        option, equals, value = arg.partition("=")
        if not equals:
            value = args[position + 1] if position + 1 < len(args) else ""
        for key, class_path in classes_named(OPTIONS.get(option, ""), value).items():
            if class_path is None:
                continue  # options only: they add to the class set
            if in_force[key] is not None and not same_class(class_path, in_force[key]):
                replaced += [f"--{key}", "null"]
            in_force[key] = class_path
        replaced.append(arg)
    return replaced


def classes_named(option: str, value: str) -> dict[str, str | None]:
    """The class each of `model` and `data` is set to by `--OPTION VALUE`; None where it sets options only."""
    if option in REPLACED_WHOLE:
        return {option: class_of(value, Path.cwd())}
    if option == "config":
        config = load(value, Path.cwd())
        if isinstance(config, dict):
            base = Path(value).parent
            return {key: class_of(config[key], base) for key in REPLACED_WHOLE if key in config}
    return {}


def class_of(spec: object, base: Path) -> str | None:
    """The class_path a spec names: an import path, a config file naming one, or a mapping with a class_path."""
    if isinstance(spec, str):
        loaded = load(spec, base)
        spec = loaded if isinstance(loaded, dict) or loaded is None else spec
    if isinstance(spec, dict):
        spec = spec.get("class_path")
    return spec if isinstance(spec, str) else None


def load(value: str, base: Path) -> object:
    """A config file's content, relative to `base`, or `value` itself read as YAML (a class name, null, a mapping)."""
    try:
        return yaml.safe_load((base / value).read_text())
    except OSError:  # no such file: the value itself
        pass
    except yaml.YAMLError:
        return None  # jsonargparse says what is wrong with the file
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError:
        return value


def same_class(one: str, other: str) -> bool:
    """Whether two class paths name one class: `Regressor` and `tasks.regression.Regressor` do."""
    if "." in one and "." in other:
        return one == other
    return one.rpartition(".")[2] == other.rpartition(".")[2]
