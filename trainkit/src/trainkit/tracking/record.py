"""What a run records about itself: its resolved config, the code version and the cluster setup."""

from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import SaveConfigCallback

from trainkit.checkpoints.provenance import KEY, collect_provenance


class SaveRunRecord(SaveConfigCallback):
    """Save the resolved config as `<default_root_dir>/config.yaml` (replacing an earlier run's), give the
    logger the run's provenance (checkpoints/provenance.py: the config, the git commit, versions, the cluster setup),
    and put that provenance in every checkpoint the run saves."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, save_to_log_dir=False, **kwargs)
        self.provenance: dict[str, Any] | None = None  # on the first process only: only it writes checkpoints

    def save_config(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        path = Path(trainer.default_root_dir, self.config_filename)
        path.parent.mkdir(parents=True, exist_ok=True)
        # One self-contained file: saved apart, composed configs such as model/x.yaml and data/x.yaml
        # would overwrite each other next to it. Dumped once (it checks the whole config each time).
        config_yaml = self.parser.dump(self.config, skip_none=False)
        path.write_text(config_yaml)
        self.provenance = collect_provenance(trainer, config_yaml)
        record = {**self.provenance, "config": yaml.safe_load(config_yaml)}
        for logger in trainer.loggers:
            logger.log_hyperparams(record)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # Lightning calls this for every checkpoint but those of `save_weights_only` (ModelCheckpoint's
        # option): best and last, periodic.ckpt, preempted.ckpt, and trainer.save_checkpoint.
        if self.provenance is not None:
            checkpoint[KEY] = self.provenance
