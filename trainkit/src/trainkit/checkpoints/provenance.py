"""Where a checkpoint came from: the code, the image, the versions, the resolved config and the cluster setup.

Every checkpoint a run saves carries it as `checkpoint["provenance"]` (tracking/record.py adds it; a
sharded checkpoint, a directory, in its meta.pt). Show it:
`python -m trainkit.checkpoints.provenance runs/experiment/checkpoints/last.ckpt`,
with `--config` for the resolved config that trained it.

The code is the git commit of the package's source, and whether the tree had uncommitted changes
(untracked files do not count) with the sha256 of `git diff HEAD`, which identifies those changes.
An image has no git repository: there the commit is what the image was built with (Dockerfile).
Everything in it is plain data, so it loads with `torch.load(weights_only=True)`.
"""

import argparse
import hashlib
import os
import pickle
import platform
import socket
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any, NoReturn

import torch
from lightning.pytorch import Trainer

from trainkit import __version__ as trainkit_version
from trainkit.checkpoints.io import refusal_reason
from trainkit.checkpoints.sharded_format import META_FILE, checkpoint_meta
from trainkit.cluster.platforms import platform_of
from trainkit.run.exit_codes import CONFIG_ERROR
from trainkit.store.object_store import StoreError, open_store

KEY = "provenance"
# Set by the Dockerfile from its build arguments: an image has no git repository to ask.
IMAGE_VARIABLE, COMMIT_VARIABLE, DIFF_VARIABLE = "PROVENANCE_IMAGE", "PROVENANCE_COMMIT", "PROVENANCE_DIFF_SHA256"
# Where a platform names the image or the job a process runs in.
PLATFORM_VARIABLES = ("APPTAINER_CONTAINER", "SINGULARITY_CONTAINER", "SLURM_JOB_ID", "SING_JOB_NAME")
EMPTY_DIFF_SHA256 = hashlib.sha256(b"").hexdigest()
SOURCE = Path(__file__).resolve().parent.parent  # the package: the code that runs, wherever the command started


def collect_provenance(trainer: Trainer, config_yaml: str) -> dict[str, Any]:
    """The provenance of this run, collected once (git runs three commands) and added to each checkpoint."""
    environment = getattr(trainer.strategy, "cluster_environment", None)
    return {
        "collected_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "git": git_state(SOURCE) or image_git_state(),
        "environment": {
            "platform": platform_of(environment).name if environment is not None else "local",
            "hostname": socket.gethostname(),
            "image": os.environ.get(IMAGE_VARIABLE),
            **{name: os.environ[name] for name in PLATFORM_VARIABLES if name in os.environ},
        },
        "versions": versions(trainer.lightning_module),
        "counts": {
            "num_nodes": trainer.num_nodes,
            "devices_per_node": trainer.num_devices,
            "world_size": trainer.world_size,
        },
        "config": config_yaml,
    }


def git_state(directory: Path) -> dict[str, Any] | None:
    """The commit checked out where `directory` is, whether the tree has changes and their hash; None outside git."""
    try:
        commit = _git(directory, "rev-parse", "HEAD").decode().strip()
        dirty = bool(_git(directory, "status", "--porcelain", "--untracked-files=no"))
        diff = _git(directory, "diff", "HEAD") if dirty else None
    except (OSError, subprocess.SubprocessError):
        return None
    diff_sha256 = hashlib.sha256(diff).hexdigest() if diff is not None else None
    return {"commit": commit, "dirty": dirty, "diff_sha256": diff_sha256, "source": "git"}


def image_git_state() -> dict[str, Any]:
    """What the image was built from, as its build arguments said; all None outside such an image."""
    commit, diff_sha256 = os.environ.get(COMMIT_VARIABLE) or None, os.environ.get(DIFF_VARIABLE) or None
    dirty = None if commit is None else diff_sha256 not in (None, EMPTY_DIFF_SHA256)
    return {"commit": commit, "dirty": dirty, "diff_sha256": diff_sha256 if dirty else None, "source": "image build"}


def versions(model: object) -> dict[str, str | None]:
    """Python's, the libraries', the kit's and that of the project whose model trains."""
    project = type(model).__module__.split(".")[0]
    return {
        "python": platform.python_version(),
        "torch": str(torch.__version__),  # a str subclass, which weights_only loading refuses
        "lightning": metadata.version("lightning"),
        project: installed_version(project),
        "trainkit": trainkit_version,
    }


def installed_version(package: str) -> str | None:
    """The version of the distribution that installed `package`; None where it runs from a path, not installed.

    Projects name their distribution as their package (lightning-mnist for lightning_mnist), so that name is
    tried first: an editable install (the README's `pip install -e .`) names no packages in its metadata.
    Only a package imported from an environment's site-packages is searched for among all installed
    distributions, which reads every one's file list (0.5 s at each start here, with 270 of them)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        pass
    if not _imported_from_site_packages(package):
        return None
    for name in metadata.packages_distributions().get(package, []):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _imported_from_site_packages(package: str) -> bool:
    module = sys.modules.get(package)
    where = Path(getattr(module, "__file__", None) or "")
    return any(folder.name in ("site-packages", "dist-packages") for folder in where.parents)


def _git(directory: Path, *args: str) -> bytes:
    return subprocess.run(["git", *args], cwd=directory, capture_output=True, check=True, timeout=10).stdout


def read_checkpoint(path: str) -> dict[str, Any]:
    """The checkpoint at `path` (a file, a sharded checkpoint's directory, or an object store URL) as data only:
    no code in it can run. Tensors are mapped, not read."""
    if "://" not in path:
        return checkpoint_meta(path)
    folder, _, name = path.rstrip("/").rpartition("/")
    store = open_store(folder, timeout=60)
    if store.names(name):  # a sharded checkpoint: a folder of objects; its meta.pt holds the provenance
        name = f"{name}/{META_FILE}"
    with tempfile.TemporaryDirectory() as scratch:
        local = Path(scratch, "checkpoint")
        store.download(name, local)
        return torch.load(local, map_location="cpu", weights_only=True)


def summary(checkpoint: dict[str, Any]) -> str:
    """A few lines: which step, which code, which versions, where and on how many processes."""
    found = checkpoint[KEY]
    git, environment, counts = found["git"], found["environment"], found["counts"]
    if git["commit"] is None:
        code = "unknown (no git repository, and not an image built with PROVENANCE_COMMIT)"
    elif git["dirty"]:
        code = f"{git['commit']} with uncommitted changes (diff sha256 {git['diff_sha256']})"
    else:
        code = f"{git['commit']} (no uncommitted changes)"
    extra = [f"{name}={value}" for name, value in environment.items() if name in PLATFORM_VARIABLES]
    lines = {
        "step": f"{checkpoint.get('global_step')} (epoch {checkpoint.get('epoch')})",
        "code": code if git["commit"] is None else f"{code}, from {git['source']}",
        "versions": ", ".join(
            f"{name} {version or 'from its folder, not installed'}" for name, version in found["versions"].items()
        ),
        "platform": f"{environment['platform']} on {environment['hostname']}: {counts['num_nodes']} node(s) x"
        f" {counts['devices_per_node']} device(s), world size {counts['world_size']}",
        "image": environment["image"] or "none named",
        **({"job": " ".join(extra)} if extra else {}),
        "collected": found["collected_at"],
    }
    return "\n".join(f"{name:<10}{value}" for name, value in lines.items())


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Show where a checkpoint came from.")
    parser.add_argument("checkpoint", help="a checkpoint (file or directory), or its URL in a store (s3://...)")
    parser.add_argument("--config", action="store_true", help="print the resolved config that trained it")
    options = parser.parse_args(args)
    try:
        checkpoint = read_checkpoint(options.checkpoint)
    except pickle.UnpicklingError as error:
        _fail(f"refused to load {options.checkpoint}: {refusal_reason(error)}")
    except (OSError, RuntimeError) as error:  # no such file, or not a checkpoint
        _fail(f"cannot read {options.checkpoint}: {error}")
    except StoreError as error:
        _fail(str(error))
    if KEY not in checkpoint:
        _fail(f"{options.checkpoint} records no provenance: saved before it was recorded, or not by train.py")
    if options.config:
        print(checkpoint[KEY]["config"], end="")  # the YAML ends with its own newline
    else:
        print(summary(checkpoint))


def _fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(CONFIG_ERROR)


if __name__ == "__main__":
    main()
