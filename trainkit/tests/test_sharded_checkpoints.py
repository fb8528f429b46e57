"""Sharded checkpoints (directories) wherever the machinery takes checkpoints: resume, ckpt_path, provenance, disk.

The directories are real ones: torch.distributed.checkpoint writes the shard and its .metadata (in this one
process), then meta.pt and the commit marker as the sharded strategy adds them.
"""

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from trainkit.checkpoints import provenance, resume, sharded_format
from trainkit.checkpoints.disk import checkpoint_bytes
from trainkit.checkpoints.path import (
    check_checkpoint_path,
    find_best_checkpoint,
    refuse_sharded_without_strategy,
)
from trainkit.checkpoints.resume import newer_from_store, resume_checkpoint
from trainkit.checkpoints.sharded_format import META_FILE, checkpoint_size, commit
from trainkit.checkpoints.stored import FOLDER, POINTER, sha256_of, stored_name
from trainkit.run.errors import ConfigError
from trainkit.store.object_store import FsspecStore
from trainkit.testing.tiny import TinyClassifier, TinyDataModule

# torch.distributed.checkpoint says that it saves in one process, as asked.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
LOGGER = "trainkit"


def sharded(path: Path, step: int, *, committed: bool = True, numbers: int = 128, meta: dict | None = None) -> Path:
    """A sharded checkpoint as the sharded strategy leaves it; `committed=False`: one whose save did not finish."""
    path.mkdir(parents=True)
    weights = {"net.2.weight": torch.full((numbers,), float(step)), "net.2.bias": torch.arange(8.0)}
    dcp.save({"state_dict": weights}, checkpoint_id=path)
    torch.save({"global_step": step, "epoch": 0, "callbacks": {}, **(meta or {})}, path / META_FILE)
    if committed:
        commit(path, step, world_size=1)
    return path


def one_file(path: Path, step: int) -> Path:
    torch.save({"state_dict": {"net.2.bias": torch.zeros(8)}, "global_step": step}, path)
    return path


def aged(path: Path, seconds: float) -> Path:
    """`path` as if written `seconds` ago: candidates are tried newest first."""
    then = time.time() - seconds
    os.utime(path, (then, then))
    return path


def trainer_saving_to(checkpoints: Path, callback: ModelCheckpoint | None = None) -> Trainer:
    callback = callback or ModelCheckpoint(dirpath=checkpoints)
    return Trainer(accelerator="cpu", logger=False, callbacks=[callback], default_root_dir=checkpoints.parent,
                   enable_progress_bar=False, enable_model_summary=False)  # fmt: skip


def logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What the machinery logged (torch.distributed.checkpoint logs the paths it saves to as well)."""
    return [record.getMessage() for record in caplog.records if record.name.split(".")[0] == LOGGER]


def test_resume_takes_the_newest_whole_sharded_checkpoint_over_an_older_file(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    aged(one_file(checkpoints / "best-epoch=0-step=3.ckpt", 3), 100)
    newest = aged(sharded(checkpoints / "last.ckpt", 9), 10)
    assert resume_checkpoint(trainer_saving_to(checkpoints)) == newest
    assert resume._global_step(newest) == 9


@pytest.mark.parametrize(
    ("how", "reason"),
    [
        ("uncommitted", "has no COMMITTED marker"),  # killed during the save
        ("shard cut short", "__0_0.distcp holds"),  # a disk that filled up, a copy cut short
        ("meta.pt overwritten", "meta.pt is damaged"),  # same size, other bytes: only loading it tells
        ("committed without .metadata", "lists no .metadata"),  # torch's part of the save had failed
    ],
)
def test_a_sharded_checkpoint_not_whole_is_set_aside_in_one_line_and_the_next_newest_resumes(
    tmp_path, caplog, how, reason
):
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    older = aged(one_file(checkpoints / "best-epoch=0-step=3.ckpt", 3), 100)
    newest = sharded(checkpoints / "last.ckpt", 9, committed=how != "uncommitted")
    if how == "shard cut short":
        shard = newest / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[:-100])
    if how == "meta.pt overwritten":
        meta = newest / META_FILE
        meta.write_bytes(bytes(meta.stat().st_size))
    if how == "committed without .metadata":
        (newest / ".metadata").unlink()
        commit(newest, 9, world_size=1)
    aged(newest, 10)

    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert resume_checkpoint(trainer_saving_to(checkpoints)) == older
    (line,) = logged(caplog)
    assert str(newest) in line and reason in line, line
    assert not newest.exists()
    (kept,) = checkpoints.glob("last.ckpt.damaged-*")
    assert (kept / "__0_0.distcp").is_file(), "kept whole for inspection"


def test_a_save_interrupted_between_its_renames_resumes_from_its_committed_hidden_directory(tmp_path, caplog):
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    aged(one_file(checkpoints / "best-epoch=0-step=3.ckpt", 3), 100)
    # The strategy renamed last.ckpt (step 9) aside, and was killed before it renamed the new one (step 12) in.
    old = aged(sharded(checkpoints / ".last.ckpt.old-5e1f0a2b", 9), 50)
    new = aged(sharded(checkpoints / ".last.ckpt.partial-5e1f0a2b", 12), 40)
    # A save killed before its commit: not a checkpoint, even with periodic.ckpt missing.
    unfinished = aged(sharded(checkpoints / ".periodic.ckpt.partial-0c9d8e7f", 15, committed=False), 5)

    with caplog.at_level(logging.INFO, logger=LOGGER):
        found = resume_checkpoint(trainer_saving_to(checkpoints))
    assert found == checkpoints / "last.ckpt"
    assert resume._global_step(found) == 12
    assert not new.exists() and old.is_dir() and unfinished.is_dir()  # the others are left to the strategy
    assert not (checkpoints / "periodic.ckpt").exists()
    finished = f"finished a save that was interrupted between its two renames: {new.name} is now {found}"
    assert logged(caplog) == [finished]
    # The job's other processes find it in place.
    assert resume_checkpoint(trainer_saving_to(checkpoints)) == found


def test_processes_of_a_job_that_finish_the_same_interrupted_save_all_resume_from_it(tmp_path, monkeypatch):
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    aged(sharded(checkpoints / ".last.ckpt.old-5e1f0a2b", 9), 50)
    new = aged(sharded(checkpoints / ".last.ckpt.partial-5e1f0a2b", 12), 40)
    checked = resume.damage

    def another_process_renames_first(path: Path) -> str | None:
        problem = checked(path)
        if path == new:
            new.rename(checkpoints / "last.ckpt")
        return problem

    monkeypatch.setattr(resume, "damage", another_process_renames_first)
    found = resume_checkpoint(trainer_saving_to(checkpoints))
    assert found == checkpoints / "last.ckpt" and resume._global_step(found) == 12


def test_an_explicit_sharded_checkpoint_is_checked_like_a_file(tmp_path):
    whole = sharded(tmp_path / "checkpoints" / "last.ckpt", 9)
    unfinished = sharded(tmp_path / "checkpoints" / "periodic.ckpt", 9, committed=False)
    check_checkpoint_path(str(whole), weights_only=None)
    with pytest.raises(ConfigError, match=rf"^ckpt_path {unfinished} is damaged: it has no COMMITTED marker"):
        check_checkpoint_path(str(unfinished), weights_only=None)
    with pytest.raises(ConfigError, match=rf"^ckpt_path {whole.parent} is a directory, not a checkpoint$"):
        check_checkpoint_path(str(whole.parent), weights_only=None)
    with pytest.raises(ConfigError, match="does not exist"):
        check_checkpoint_path(str(tmp_path / "gone.ckpt"), weights_only=None)


def test_ckpt_path_best_is_found_among_sharded_checkpoints_of_a_run_directory_moved_since(tmp_path):
    checkpoints = tmp_path / "moved" / "checkpoints"
    callback = ModelCheckpoint(dirpath=checkpoints, monitor="val/loss", filename="best-{epoch}-{step}")
    best = aged(sharded(checkpoints / "best-epoch=0-step=9.ckpt", 9), 50)
    recorded = {callback.state_key: {"best_model_path": f"/where/it/ran/checkpoints/{best.name}"}}
    aged(sharded(checkpoints / "last.ckpt", 12, meta={"callbacks": recorded}), 10)
    find_best_checkpoint(callback)
    assert callback.best_model_path == str(best)

    callback.best_model_path = ""
    best.rename(best.with_name("elsewhere.ckpt"))
    with pytest.raises(ConfigError, match=f"names {best.name} as the best checkpoint, not in"):
        find_best_checkpoint(callback)


def test_provenance_is_shown_from_a_sharded_checkpoint(tmp_path, capsys):
    found = {
        "collected_at": "2026-01-02T03:04:05+00:00",
        "git": {"commit": "abc123", "dirty": False, "diff_sha256": None, "source": "git"},
        "environment": {"platform": "sing", "hostname": "node-0", "image": None},
        "versions": {"python": "3.11", "torch": "2.14.1"},
        "counts": {"num_nodes": 2, "devices_per_node": 2, "world_size": 4},
        "config": "trainer:\n  max_epochs: 3\n",
    }
    checkpoint = sharded(tmp_path / "last.ckpt", 12, meta={provenance.KEY: found})
    provenance.main([str(checkpoint)])
    shown = capsys.readouterr().out
    assert "step      12 (epoch 0)" in shown and "abc123 (no uncommitted changes)" in shown
    assert "2 node(s) x 2 device(s), world size 4" in shown
    provenance.main([str(checkpoint), "--config"])
    assert capsys.readouterr().out == found["config"]


def test_a_sharded_checkpoint_without_the_sharded_strategy_is_refused_in_one_line_that_names_the_ways_out(tmp_path):
    directory = sharded(tmp_path / "last.ckpt", 9)
    with pytest.raises(ConfigError) as refused:
        refuse_sharded_without_strategy(directory, sharded_strategy=False)
    message = str(refused.value)
    assert message.startswith(f"ckpt_path {directory} is a sharded checkpoint") and "\n" not in message
    assert "--config configs/strategy/fsdp.yaml" in message
    assert f"python -m trainkit.checkpoints.sharded_format {directory} OUT.ckpt" in message
    refuse_sharded_without_strategy(directory, sharded_strategy=True)
    refuse_sharded_without_strategy(one_file(tmp_path / "file.ckpt", 9), sharded_strategy=False)
    refuse_sharded_without_strategy(None, sharded_strategy=False)


def test_the_conversion_the_refusal_names_gives_one_file_that_resumes_without_the_sharded_strategy(tmp_path):
    def trainer(steps: int) -> Trainer:
        return Trainer(accelerator="cpu", max_steps=steps, limit_val_batches=0, logger=False, default_root_dir=tmp_path,
                       enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip

    model, data = TinyClassifier(), TinyDataModule(train_size=64, val_size=8, test_size=8, batch_size=16)
    first = trainer(2)
    first.fit(model, data)
    # Saved as the sharded strategy saves: weights and optimizer state keyed by parameter name, the rest in meta.pt.
    checkpoint = first._checkpoint_connector.dump_checkpoint()
    (optimizer,) = first.optimizers
    shards = {"state_dict": get_model_state_dict(model), "optimizer_0": get_optimizer_state_dict(model, optimizer)}
    del checkpoint["state_dict"], checkpoint["optimizer_states"]
    directory = tmp_path / "last.ckpt"
    directory.mkdir()
    dcp.save(shards, checkpoint_id=directory)
    torch.save(checkpoint, directory / META_FILE)
    commit(directory, step=2, world_size=1)

    out = tmp_path / "one-file.ckpt"
    sharded_format.main([str(directory), str(out)])
    assert resume.damage(out) is None
    resumed, second = TinyClassifier(), trainer(4)
    second.fit(resumed, data, ckpt_path=out)
    assert second.global_step == 4  # resumed at step 2
    # The optimizer's state went to the right parameters: compare it after loading, before any step.
    reloaded = TinyClassifier()
    fresh = torch.optim.Adam(reloaded.parameters())
    fresh.load_state_dict(torch.load(out, weights_only=True)["optimizer_states"][0])
    saved = {name: optimizer.state[parameter] for name, parameter in model.named_parameters()}
    for name, parameter in reloaded.named_parameters():
        assert torch.equal(fresh.state[parameter]["exp_avg"], saved[name]["exp_avg"]), name

    (directory / "__0_0.distcp").unlink()
    with pytest.raises(SystemExit) as refused:
        sharded_format.main([str(directory), str(tmp_path / "other.ckpt")])
    assert refused.value.code == 2 and not (tmp_path / "other.ckpt").exists()


def test_the_disk_check_counts_every_file_of_a_sharded_checkpoint(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    directory = sharded(checkpoints / "last.ckpt", 9, numbers=100_000)
    files = sum(file.stat().st_size for file in directory.iterdir())
    assert checkpoint_size(directory) == files > 400_000  # 100,000 float32 numbers, not the directory's inode
    assert checkpoint_bytes([checkpoints], TinyClassifier()) == files


def test_a_newer_checkpoint_in_the_store_goes_beside_a_sharded_one_of_the_same_name(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    local = sharded(checkpoints / "last.ckpt", 5)
    store = FsspecStore(f"file://{tmp_path}/store")
    stored = one_file(tmp_path / "uploaded.ckpt", 9)
    name = f"{FOLDER}/{stored_name('last.ckpt', 9)}"
    store.upload(stored, name)
    pointer = {"checkpoint": name, "file": "last.ckpt", "step": 9, "sha256": sha256_of(stored)}
    store.write(POINTER, json.dumps(pointer).encode(), replacing=None)

    found = newer_from_store(store, checkpoints, local_step=resume._global_step(local))
    assert found == checkpoints / "last-step=9.ckpt"
    assert hashlib.sha256(found.read_bytes()).hexdigest() == pointer["sha256"]
    assert resume.damage(local) is None  # the sharded one is as it was
