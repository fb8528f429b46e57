"""Sharded checkpoints (directories) in a checkpoint store: stored file by file with the commit marker last, kept and
deleted as one version each, and downloaded whole on a fresh disk.

The unit tests store real DCP directories (test_sharded_checkpoints.sharded) in a store on this disk (file://) and,
among the slow tests, in moto's S3 server through boto3; the drill preempts a 2-process sharded run and resumes it
from the store on a fresh disk.
"""

import hashlib
import json
import logging
import shutil
import signal
import threading
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from trainkit.checkpoints import resume
from trainkit.checkpoints.path import find_best_checkpoint
from trainkit.checkpoints.resume import newer_from_store
from trainkit.checkpoints.sharded_format import COMMIT_MARKER, checkpoint_meta
from trainkit.checkpoints.stored import POINTER, StoredCheckpointIO, stored_versions
from trainkit.store.object_store import FsspecStore, ObjectStore, open_store

from .drills import exit_code, paced, start, wait_for
from .helpers import clean_env
from .test_sharded import STEPS, sharded_args
from .test_sharded_checkpoints import LOGGER, logged, sharded

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("boto3")
    pytest.importorskip("moto.server", reason="moto[server] is in the project's test extra: pip install -e '.[test]'")
    from .test_object_store import start_s3_server

    server = start_s3_server(tmp_path_factory.mktemp("s3") / "server.log", with_credentials=False)
    yield server
    server.process.kill()
    server.process.wait()


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.slow)])
def store(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ObjectStore:
    if request.param == "file":
        return FsspecStore(f"file://{tmp_path}/store")
    server = request.getfixturevalue("s3_server")
    for name, value in server.env().items():
        if name.startswith("AWS_"):
            monkeypatch.setenv(name, value)
    return open_store(f"s3://checkpoints/{tmp_path.name}", timeout=5)


def saved(checkpoints: Path, name: str, step: int, **kwargs) -> Path:
    """A sharded checkpoint in place of the one of that name, as the strategy's swap leaves it."""
    path = checkpoints / name
    shutil.rmtree(path, ignore_errors=True)
    return sharded(path, step, **kwargs)


def pointer_of(store: ObjectStore) -> dict | None:
    found = store.read_json(POINTER)
    return found[0] if found else None


def test_a_sharded_checkpoint_is_stored_file_by_file_and_the_pointer_moves_after_its_marker(store, tmp_path):
    io = StoredCheckpointIO(store)
    checkpoints = tmp_path / "checkpoints"
    path = saved(checkpoints, "last.ckpt", 9)
    marker = (path / COMMIT_MARKER).read_bytes()
    files = {file.name: file.stat().st_size for file in path.iterdir()}

    uploads: list[tuple[str, dict | None]] = []  # each object stored, and the pointer when it was
    replaced = threading.Event()
    upload = store.upload

    def recorded_upload(local: Path, name: str) -> None:
        replaced.wait(timeout=30)
        uploads.append((name, pointer_of(store)))
        upload(local, name)

    store.upload = recorded_upload
    io.written(path, 9)
    saved(checkpoints, "last.ckpt", 12)  # the next save replaces the directory before the upload has begun
    replaced.set()
    io.wait()

    version = "checkpoints/last-step=9.ckpt"
    assert sorted(name for name, _ in uploads) == sorted(f"{version}/{file}" for file in files)
    assert uploads[-1][0] == f"{version}/{COMMIT_MARKER}", "the commit marker goes last"
    assert all(pointer is None for _, pointer in uploads), "the pointer moved before every file was stored"
    pointer = pointer_of(store)
    assert pointer["checkpoint"] == version and pointer["file"] == "last.ckpt" and pointer["step"] == 9
    assert pointer["directory"] is True and pointer["bytes"] == sum(files.values())
    assert pointer["sha256"] == hashlib.sha256(marker).hexdigest()
    assert io.latest == f"{store.url}/{version}"
    assert not list(checkpoints.glob(".*upload*")), "the snapshot was left behind"

    found = newer_from_store(store, tmp_path / "fresh", local_step=-1)
    assert found == tmp_path / "fresh" / "last.ckpt"
    assert checkpoint_meta(found)["global_step"] == 9, "the upload read the next save's files"
    assert resume.damage(found) is None


def test_the_store_keeps_each_sharded_checkpoint_as_one_version(store, tmp_path):
    io = StoredCheckpointIO(store, keep=2)
    checkpoints = tmp_path / "checkpoints"
    best = saved(checkpoints, "best-epoch=0-step=3.ckpt", 3)
    io.written(best, 3)
    for step in (3, 6):
        io.written(saved(checkpoints, "last.ckpt", step), step)
    io.wait()
    # Left by a killed job: a version whose upload was cut short (no marker), and stray shards of another
    # attempt at the next version's name (say on more processes).
    leftover = tmp_path / "leftover"
    leftover.write_bytes(b"shard")
    store.upload(leftover, "checkpoints/periodic-step=4.ckpt/__0_0.distcp")
    store.upload(leftover, "checkpoints/last-step=9.ckpt/__3_0.distcp")
    io.written(saved(checkpoints, "last.ckpt", 9), 9)
    io.remove_checkpoint(best)  # no longer among the best: gone from the store too
    io.wait()

    versions = stored_versions(store)
    assert sorted(versions) == ["checkpoints/last-step=6.ckpt", "checkpoints/last-step=9.ckpt"]
    on_disk = sorted(file.name for file in (checkpoints / "last.ckpt").iterdir())
    for version, objects in versions.items():
        assert sorted(name.removeprefix(f"{version}/") for name in objects) == on_disk, version
    assert not best.exists()


def test_resume_skips_a_sharded_checkpoint_missing_in_the_store_for_the_next_newest(store, tmp_path, caplog):
    io = StoredCheckpointIO(store, keep=5)
    checkpoints = tmp_path / "checkpoints"
    for step in (3, 6, 9):
        io.written(saved(checkpoints, "last.ckpt", step), step)
    io.wait()
    store.delete("checkpoints/last-step=9.ckpt/__0_0.distcp")  # the pointer's
    store.delete(f"checkpoints/last-step=6.ckpt/{COMMIT_MARKER}")  # a deletion cut short

    fresh = tmp_path / "fresh"
    with caplog.at_level(logging.INFO, logger=LOGGER):
        found = newer_from_store(store, fresh, local_step=-1)
    assert found == fresh / "last-step=3.ckpt" and checkpoint_meta(found)["global_step"] == 3
    assert resume.damage(found) is None
    where = f"{store.url}/checkpoints"
    assert logged(caplog) == [
        f"skipped {where}/last-step=9.ckpt: it is damaged (__0_0.distcp is missing from the store)",
        f"skipped {where}/last-step=6.ckpt: it is damaged (it has no COMMITTED marker: its upload, or its deletion,"
        " was cut short)",
    ]
    assert sorted(path.name for path in fresh.iterdir()) == ["last-step=3.ckpt"], "a download was left behind"
    assert newer_from_store(store, fresh, local_step=3) is None


def test_processes_sharing_the_directory_resume_from_one_download(store, tmp_path, monkeypatch):
    io = StoredCheckpointIO(store)
    checkpoints = tmp_path / "checkpoints"
    io.written(saved(checkpoints, "last.ckpt", 9), 9)
    io.wait()
    fresh = tmp_path / "fresh"
    download = store.download
    others = []

    def another_process_is_first(name: str, local: Path) -> None:
        if not others:  # another process of the job downloads the whole checkpoint and renames it into place
            others.append(None)
            others[0] = newer_from_store(store, fresh, local_step=-1)
        download(name, local)

    monkeypatch.setattr(store, "download", another_process_is_first)
    found = newer_from_store(store, fresh, local_step=-1)
    assert found == others[0] == fresh / "last.ckpt" and checkpoint_meta(found)["global_step"] == 9
    assert [path.name for path in fresh.iterdir()] == ["last.ckpt"], "a second copy, or a download left behind"
    # A process that starts later finds it in place; an older checkpoint of that name is left as it was.
    assert newer_from_store(store, fresh, local_step=-1) == found
    older = saved(tmp_path / "older", "last.ckpt", 5)
    assert newer_from_store(store, older.parent, local_step=-1) == older.parent / "last-step=9.ckpt"
    assert checkpoint_meta(older)["global_step"] == 5


def test_ckpt_path_best_downloads_a_sharded_best_checkpoint_on_a_fresh_disk(store, tmp_path):
    io = StoredCheckpointIO(store)
    checkpoints = tmp_path / "checkpoints"
    callback = ModelCheckpoint(dirpath=tmp_path / "fresh", monitor="val/loss", filename="best-{epoch}-{step}")
    io.written(saved(checkpoints, "best-epoch=0-step=3.ckpt", 3), 3)
    recorded = {callback.state_key: {"best_model_path": str(checkpoints / "best-epoch=0-step=3.ckpt")}}
    io.written(saved(checkpoints, "last.ckpt", 6, meta={"callbacks": recorded}), 6)
    io.wait()
    shutil.rmtree(checkpoints)  # a fresh disk

    find_best_checkpoint(callback, store)
    best = tmp_path / "fresh" / "best-epoch=0-step=3.ckpt"
    assert callback.best_model_path == str(best)
    assert resume.damage(best) is None and checkpoint_meta(best)["global_step"] == 3


@pytest.mark.slow
def test_a_preempted_sharded_run_resumes_from_the_store_on_a_fresh_disk(experiment, tmp_path):
    """2 processes, FSDP2: SIGTERM mid-epoch, the run directory deleted, the same command: the weights of an
    uninterrupted run. The uninterrupted one runs meanwhile (the preempted one spends most of its time paced)."""
    store = f"file://{tmp_path}/store"

    def args(name: str, *extra: str) -> list[str]:
        return [*sharded_args(experiment, tmp_path / name, 32, 2),
                "--trainer.callbacks+=trainkit.testing.rank_report.ReportRank",
                "--trainer.callbacks.out_dir", str(tmp_path / f"{name}-reports"), *extra]  # fmt: skip

    reference = start(args("reference"), clean_env(), tmp_path / "reference.log")
    marker, log = tmp_path / "step-4", tmp_path / "preempted.log"
    job = start(args("run", "--checkpoint_store.url", store, *paced(marker, at_step=4)), clean_env(), log)
    wait_for(marker, job, log)
    job.send_signal(signal.SIGTERM)
    assert exit_code(job, 120, "the preempted sharded run hung") == 143, log.read_text()[-4000:]
    pointer = json.loads((tmp_path / "store" / POINTER).read_text())
    assert pointer["file"] == "preempted.ckpt" and pointer["directory"] and 4 <= pointer["step"] < STEPS, pointer
    url = f"{store}/{pointer['checkpoint']}"
    assert f"stored as {url}" in log.read_text(), log.read_text()[-3000:]

    shutil.rmtree(tmp_path / "run")  # a new node: nothing of the run on its disk
    resumed = start(args("run", "--checkpoint_store.url", store), clean_env(), tmp_path / "resumed.log")
    assert exit_code(resumed, 300, "the resumed sharded run hung") == 0, (tmp_path / "resumed.log").read_text()[-4000:]
    assert exit_code(reference, 300, "the reference run hung") == 0, (tmp_path / "reference.log").read_text()[-4000:]
    text = (tmp_path / "resumed.log").read_text()
    assert f"resuming from {url} (step {pointer['step']})" in text, text[-3000:]
    preempted = tmp_path / "run" / "checkpoints" / "preempted.ckpt"
    assert f"Restoring states from the checkpoint path at {preempted}" in text, text[-3000:]

    def reports(name: str) -> list[dict]:
        return [json.loads(path.read_text()) for path in sorted((tmp_path / f"{name}-reports").glob("rank*.json"))]

    assert [report["global_step"] for report in reports("run")] == [STEPS, STEPS]
    assert {report["weights"] for report in reports("run")} == {report["weights"] for report in reports("reference")}
