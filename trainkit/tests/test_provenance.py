"""Every checkpoint says where it came from: commit, uncommitted changes, versions, cluster setup and config."""

import hashlib
import importlib
import os
import platform
import shutil
import signal
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch
import yaml

import trainkit
from trainkit.checkpoints import provenance
from trainkit.checkpoints.provenance import installed_version, versions

from .conftest import KIT_ROOT
from .drills import TWO_PROCESS_STEPS_PER_EPOCH, exit_code, full_epochs_args, load, paced, wait_for, with_periodic
from .helpers import PROJECT_ROOT, clean_env

SHOW = [sys.executable, "-m", "trainkit.checkpoints.provenance"]
LEFT_BEHIND = ("runs", "data", "wandb", "lightning_logs", "__pycache__", ".*", "*.ckpt")


def git(repo: Path, *args: str) -> bytes:
    command = ["git", "-c", "user.name=Test", "-c", "user.email=test@example.com", *args]
    return subprocess.run(command, cwd=repo, capture_output=True, check=True).stdout


def show(*args: str, cwd: Path = PROJECT_ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([*SHOW, *args], cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_every_checkpoint_of_a_run_records_its_commit_changes_versions_setup_and_config(experiment, tmp_path):
    # The project committed to a repository of its own, then changed without committing, as a researcher
    # trying something does; train.py runs from there, with that copy's package.
    repo = tmp_path / "project"
    shutil.copytree(PROJECT_ROOT, repo, ignore=shutil.ignore_patterns(*LEFT_BEHIND))
    shutil.copytree(
        KIT_ROOT / "src" / "trainkit", repo / "src" / "trainkit", ignore=shutil.ignore_patterns("__pycache__")
    )
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "the experiment")
    with (repo / "train.py").open("a") as script:
        script.write("# an uncommitted change\n")
    commit = git(repo, "rev-parse", "HEAD").decode().strip()
    diff_sha256 = hashlib.sha256(git(repo, "diff", "HEAD")).hexdigest()

    # 2 processes, 9 steps an epoch: last.ckpt after step 9, periodic.ckpt every 4 steps, SIGTERM after step 12.
    periodic_experiment = with_periodic(experiment, every_n_steps=4)
    run_dir, marker, log = tmp_path / "run", tmp_path / "step-12", tmp_path / "train.log"
    args = ["fit", *full_epochs_args(periodic_experiment, run_dir), "--trainer.devices", "2", *paced(marker, 12)]
    with log.open("w") as output:  # the job writes its own copy
        job = subprocess.Popen(
            [sys.executable, "train.py", *args],
            cwd=repo,
            env=clean_env(PYTHONPATH=str(repo / "src")),
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    wait_for(marker, job, log)
    job.send_signal(signal.SIGTERM)
    assert exit_code(job, timeout=60, hang="the job did not stop after SIGTERM") == 143, log.read_text()[-4000:]

    checkpoints = run_dir / "checkpoints"
    saved = {name: load(checkpoints / name) for name in ("last.ckpt", "periodic.ckpt", "preempted.ckpt")}
    assert saved["last.ckpt"]["global_step"] == TWO_PROCESS_STEPS_PER_EPOCH
    assert saved["periodic.ckpt"]["global_step"] in (8, 12)
    assert saved["preempted.ckpt"]["global_step"] > 12
    resolved_config = yaml.safe_load((run_dir / "config.yaml").read_text())
    for name, checkpoint in saved.items():
        found = checkpoint["provenance"]
        assert found["git"] == {"commit": commit, "dirty": True, "diff_sha256": diff_sha256, "source": "git"}, name
        assert found["versions"]["python"] == platform.python_version()
        assert found["versions"]["torch"] == torch.__version__
        assert found["versions"]["lightning"] == metadata.version("lightning")
        assert found["counts"] == {"num_nodes": 1, "devices_per_node": 2, "world_size": 2}
        assert yaml.safe_load(found["config"]) == resolved_config
    periodic = [c for c in resolved_config["trainer"]["callbacks"] if c["class_path"].endswith(".PeriodicCheckpoint")]
    assert periodic[0]["init_args"]["every_n_steps"] == 4  # the run's own settings, not the file's defaults

    shown = show(str(checkpoints / "preempted.ckpt"))
    assert shown.returncode == 0, shown.stderr
    assert f"{commit} with uncommitted changes (diff sha256 {diff_sha256})" in shown.stdout
    assert f"step      {saved['preempted.ckpt']['global_step']} (epoch 1)" in shown.stdout
    assert f"torch {torch.__version__}, lightning {metadata.version('lightning')}" in shown.stdout
    assert "1 node(s) x 2 device(s), world size 2" in shown.stdout
    shown_config = show("--config", str(checkpoints / "last.ckpt"))
    assert yaml.safe_load(shown_config.stdout) == resolved_config


def test_outside_git_the_commit_is_the_one_the_image_was_built_with(tmp_path, monkeypatch):
    assert provenance.git_state(tmp_path) is None  # no repository: the Dockerfile's build arguments say it
    monkeypatch.delenv(provenance.COMMIT_VARIABLE, raising=False)
    assert provenance.image_git_state()["commit"] is None
    monkeypatch.setenv(provenance.COMMIT_VARIABLE, "abc123")
    monkeypatch.setenv(provenance.DIFF_VARIABLE, provenance.EMPTY_DIFF_SHA256)  # `git diff HEAD` printed nothing
    assert provenance.image_git_state() == {"commit": "abc123", "dirty": False, "diff_sha256": None,
                                            "source": "image build"}  # fmt: skip
    monkeypatch.setenv(provenance.DIFF_VARIABLE, "f" * 64)
    assert provenance.image_git_state()["dirty"] is True


def test_code_of_no_commit_is_said_to_be_unknown_and_from_nowhere(monkeypatch):
    monkeypatch.delenv(provenance.COMMIT_VARIABLE, raising=False)
    found = {"git": provenance.image_git_state(), "versions": {}, "collected_at": "now",
             "environment": {"platform": "local", "hostname": "laptop", "image": None},
             "counts": {"num_nodes": 1, "devices_per_node": 1, "world_size": 1}}  # fmt: skip
    (code,) = [line for line in provenance.summary({provenance.KEY: found}).splitlines() if line.startswith("code")]
    assert code == "code      unknown (no git repository, and not an image built with PROVENANCE_COMMIT)"


def test_show_refuses_checkpoints_that_could_run_code_and_says_when_none_is_recorded(tmp_path):
    unsafe, plain = tmp_path / "unsafe.ckpt", tmp_path / "plain.ckpt"
    torch.save({"state_dict": {}, "hook": os.system}, unsafe)  # unpickling it would import os.system
    torch.save({"state_dict": {"w": torch.zeros(2)}, "global_step": 3}, plain)
    refused, missing = show(str(unsafe)), show(str(plain))
    assert refused.returncode == missing.returncode == 2
    assert refused.stderr.startswith("error: refused to load") and "GLOBAL" in refused.stderr
    assert "records no provenance" in missing.stderr
    assert refused.stdout == missing.stdout == ""


def test_versions_name_the_kit_and_the_installed_project_of_the_model(monkeypatch, tmp_path):
    class ProjectModel:  # as if defined in the package `yaml`, which the distribution PyYAML installs
        __module__ = "yaml.models"

    found = versions(ProjectModel())
    assert found["trainkit"] == trainkit.__version__ and found["yaml"] == yaml.__version__

    # An editable install names no packages in its metadata: the distribution is found by the package's name,
    # without reading every installed distribution's file list.
    def no_search() -> dict:
        raise AssertionError("searched every installed distribution for the package")

    monkeypatch.setattr(metadata, "packages_distributions", no_search)
    assert installed_version("pytest_cookies") == metadata.version("pytest-cookies")
    monkeypatch.setattr(metadata, "packages_distributions", dict)
    assert installed_version("not_a_package_here") is None
    # Nor for a package that runs from a path, as a project does from its folder (`PYTHONPATH=src`).
    (tmp_path / "project_from_a_path").mkdir()
    (tmp_path / "project_from_a_path" / "__init__.py").touch()
    monkeypatch.syspath_prepend(tmp_path)
    importlib.import_module("project_from_a_path")
    monkeypatch.setattr(metadata, "packages_distributions", no_search)
    assert installed_version("project_from_a_path") is None
