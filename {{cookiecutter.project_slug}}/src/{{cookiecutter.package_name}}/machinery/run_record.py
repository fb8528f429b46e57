"""What a run records about itself: its resolved config, the code version and the cluster setup."""

import subprocess
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import SaveConfigCallback


class SaveRunRecord(SaveConfigCallback):
    """Save the resolved config as `<default_root_dir>/config.yaml` (replacing an earlier run's) and
    give the logger the config, the git commit (and whether the tree had changes) and the cluster setup."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, save_to_log_dir=False, **kwargs)

    def save_config(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        path = Path(trainer.default_root_dir, self.config_filename)
        path.parent.mkdir(parents=True, exist_ok=True)
        # One self-contained file: saved apart, composed configs such as model/x.yaml and data/x.yaml
        # would overwrite each other next to it.
        self.parser.save(self.config, path, skip_none=False, overwrite=True, multifile=False)
        record = {
            "config": yaml.safe_load(self.parser.dump(self.config, skip_none=False)),
            "git": git_state(),
            "cluster": {
                "environment": type(getattr(trainer.strategy, "cluster_environment", None)).__name__,
                "num_nodes": trainer.num_nodes,
                "devices_per_node": trainer.num_devices,
                "world_size": trainer.world_size,
            },
        }
        for logger in trainer.loggers:
            logger.log_hyperparams(record)


def git_state(directory: str = ".") -> dict[str, str | bool | None]:
    """The commit checked out in `directory` and whether the tree has uncommitted changes."""
    try:
        commit = _git(directory, "rev-parse", "HEAD")
        dirty = bool(_git(directory, "status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": dirty}


def _git(directory: str, *args: str) -> str:
    result = subprocess.run(["git", *args], cwd=directory, capture_output=True, text=True, check=True, timeout=10)
    return result.stdout.strip()
