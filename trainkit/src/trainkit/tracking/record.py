"""What a run records about itself: its resolved config, the code version and the cluster setup."""

import json
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info

from trainkit.checkpoints.provenance import KEY, collect_provenance


class SaveRunRecord(SaveConfigCallback):
    """Save the resolved config of a fit as `<default_root_dir>/config.yaml` (replacing an earlier run's) once it
    starts training, give the logger the run's provenance (checkpoints/provenance.py: the config, the git commit,
    versions, the cluster setup), and put that provenance in every checkpoint the run saves. A fit that resumes from
    a checkpoint trained with another config says what differs: the optimizer's state, its learning rate among it,
    comes from the checkpoint."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, save_to_log_dir=False, **kwargs)
        self.provenance: dict[str, Any] | None = None  # on the first process only: only it writes checkpoints

    def save_config(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # One self-contained file: saved apart, composed configs such as model/x.yaml and data/x.yaml
        # would overwrite each other next to it. Dumped once (it checks the whole config each time).
        config_yaml = self.parser.dump(self.config, skip_none=False)
        self.provenance = collect_provenance(trainer, config_yaml)
        record = {**self.provenance, "config": yaml.safe_load(config_yaml)}
        for logger in trainer.loggers:
            logger.log_hyperparams(record)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Not before: a fit refused as it sets up (a checkpoint that does not fit, an optimizer setting torch
        # refuses) would replace the config of the run whose checkpoints are here. Validate, test and predict
        # read a run: its config is the one fit trained with.
        if self.provenance is not None:
            path = Path(trainer.default_root_dir, self.config_filename)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(self.provenance["config"])

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # Lightning calls this for every checkpoint but those of `save_weights_only` (ModelCheckpoint's
        # option): best and last, periodic.ckpt, preempted.ckpt, and trainer.save_checkpoint.
        if self.provenance is not None:
            checkpoint[KEY] = self.provenance

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        trained_with = checkpoint.get(KEY, {}).get("config")
        if trainer.state.fn != TrainerFn.FITTING or self.provenance is None or trained_with is None:
            return
        # Where the run resumed from is no setting of its training.
        before, now = (
            without_ckpt_path(yaml.safe_load(config)) for config in (trained_with, self.provenance["config"])
        )
        changes = config_changes(before, now)
        if changes:
            more = f" (and {len(changes) - 5} more)" if len(changes) > 5 else ""
            rank_zero_info(
                f"resume: {trainer.ckpt_path} was trained with another config: {', '.join(changes[:5])}{more}"
            )


def keep_hyperparameters_apart(model: LightningModule, data: LightningDataModule) -> None:
    """Lightning logs the model's and the data module's hyperparameters as one set, and refuses to start a fit where
    a name is in both with two values: the example model's `channels` (its width) beside an image folder's (its
    colours), a `seed` of each. The logger has both whole in the run's config (SaveRunRecord): the data module's own
    set is left out then."""
    ours, theirs = model.hparams_initial, data.hparams_initial
    if any(not same_value(ours[name], theirs[name]) for name in ours.keys() & theirs.keys()):
        data._log_hyperparams = False  # what `save_hyperparameters(logger=False)` sets


def same_value(one: Any, other: Any) -> bool:
    if isinstance(one, torch.Tensor) or isinstance(other, torch.Tensor):
        return isinstance(one, torch.Tensor) and isinstance(other, torch.Tensor) and torch.equal(one, other)
    return bool(one == other)


def without_ckpt_path(config: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in config.items() if key != "ckpt_path"}


def config_changes(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """`key value (was value)` for each setting that differs, by dotted key in alphabetical order; a callback (or any
    class in a list) that only one has is `added` or `left out` as a whole."""
    before, now = flat(before), flat(now)
    # A class only one has: one entry for it, not one for each of its settings.
    whole = {
        key.removesuffix("class_path"): key in now for key in before.keys() ^ now.keys() if key.endswith(".class_path")
    }
    changes = [f"{prefix[:-1]} {'added' if added else 'left out'}" for prefix, added in whole.items()]
    for key in before.keys() | now.keys():
        if before.get(key) != now.get(key) and not key.startswith(tuple(whole)):
            changes.append(f"{key} {shown(now.get(key))} (was {shown(before.get(key))})")
    return sorted(changes)


def flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as one level of dotted keys. A list of classes, such as the callbacks, is keyed by their
    names (`trainer.callbacks.ModelCheckpoint.init_args.every_n_epochs`); other lists stay whole."""
    flattened: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, list) and value and all(isinstance(item, dict) and "class_path" in item for item in value):
            value = by_class_name(value)
        if isinstance(value, dict) and value:
            flattened.update(flat(value, f"{prefix}{key}."))
        else:
            flattened[f"{prefix}{key}"] = value
    return flattened


def by_class_name(items: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Classes by their names, the second of a name as `Name[2]`, and so on."""
    named: dict[str, dict[str, Any]] = {}
    for item in items:
        name = item["class_path"].rsplit(".", 1)[-1]
        count = sum(key.split("[")[0] == name for key in named)
        named[name if count == 0 else f"{name}[{count + 1}]"] = item
    return named


def shown(value: Any) -> str:
    text = value if isinstance(value, str | int | float) and not isinstance(value, bool) else json.dumps(value)
    text = str(text)
    return text if len(text) <= 60 else text[:57] + "..."
