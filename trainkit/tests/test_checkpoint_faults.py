"""The checkpoints a job resumes from, under damage and misuse: what the next run of the same command does."""

import hashlib
import os
import re
import shutil
import signal
import stat
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from .drills import STEPS_PER_EPOCH, full_epochs_args, load, paced, start, wait_for
from .helpers import clean_env, run_train
from .test_reliability import write_malicious_checkpoint

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def one_epoch(experiment: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory after one whole epoch: checkpoints/last.ckpt and best-epoch=0-step=18.ckpt."""
    run_dir = tmp_path_factory.mktemp("one-epoch") / "run"
    result = run_train("fit", *full_epochs_args(experiment, run_dir, epochs=1))
    assert result.returncode == 0, result.stderr[-4000:]
    return run_dir


def damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":  # a node died mid-write on a file system without atomic renames
        path.write_bytes(data[: len(data) // 2])
    elif how == "zeroed":  # a disk that filled up, or lost the file's blocks
        path.write_bytes(bytes(len(data)))
    else:  # a block of zeros inside the largest tensor: torch.load itself reads it without a word
        with zipfile.ZipFile(path) as archive:
            largest = max((info for info in archive.infolist() if "/data/" in info.filename), key=lambda i: i.file_size)
        # The tensor's bytes follow its local header: 30 bytes, then the name and the extra field.
        name_length, extra_length = struct.unpack("<HH", data[largest.header_offset + 26 : largest.header_offset + 30])
        start = largest.header_offset + 30 + name_length + extra_length + largest.file_size // 4
        path.write_bytes(data[:start] + bytes(512) + data[start + 512 :])


@pytest.mark.parametrize(
    ("newest", "how", "fallback"),
    [
        ("preempted.ckpt", "truncated", "last.ckpt"),
        ("last.ckpt", "zeroed", "best-epoch=0-step=18.ckpt"),
        ("last.ckpt", "a zeroed block", "best-epoch=0-step=18.ckpt"),
    ],
)
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_next_newest_resumes(
    one_epoch, experiment, tmp_path, newest, how, fallback
):
    run_dir = tmp_path / "run"
    shutil.copytree(one_epoch, run_dir)
    checkpoints = run_dir / "checkpoints"
    if newest == "preempted.ckpt":  # stands for a preemption checkpoint written after the epoch's end
        shutil.copy(checkpoints / "last.ckpt", checkpoints / newest)
    damage(checkpoints / newest, how)
    os.utime(checkpoints / newest)  # the newest file in the directory

    result = run_train("fit", *full_epochs_args(experiment, run_dir, epochs=2))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    skipped = [line for line in output.splitlines() if "skipped" in line and newest in line]
    assert len(skipped) == 1 and "damaged" in skipped[0], output[-4000:]
    assert f"Restoring states from the checkpoint path at {checkpoints / fallback}" in output
    assert "Traceback" not in output
    kept = list(checkpoints.glob(f"{newest}.damaged-*"))
    assert len(kept) == 1, "the damaged file is kept for inspection"
    assert load(checkpoints / "last.ckpt")["global_step"] == 2 * STEPS_PER_EPOCH  # resumed at step 18, not 0


def test_a_checkpoint_that_holds_code_is_refused_not_resumed_from(one_epoch, experiment, tmp_path):
    run_dir, proof = tmp_path / "run", tmp_path / "code-ran"
    shutil.copytree(one_epoch, run_dir)
    write_malicious_checkpoint(run_dir / "checkpoints" / "planted.ckpt", proof)

    for extra, message in (([], "refused to resume from"), (["--weights_only", "false"], "needs ckpt_path to name")):
        result = run_train("fit", *full_epochs_args(experiment, run_dir, epochs=2), *extra)
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert result.returncode == 2 and len(errors) == 1 and message in errors[0], result.stderr[-3000:]
        assert not proof.exists(), "resuming ran the checkpoint's code"


def test_a_model_that_saves_what_a_resume_refuses_is_told_at_the_first_save(experiment, tmp_path):
    run_dir = tmp_path / "run"
    numpy_numbers = ["--model", "tasks.broken.KeepsNumpyNumbers", "--data", "tasks.regression.Table",
                     "--best_checkpoint.monitor", "val_loss"]  # fmt: skip
    first = run_train("fit", *full_epochs_args(experiment, run_dir, epochs=1), *numpy_numbers)
    assert first.returncode == 0, first.stderr[-3000:]
    advice = ("save numbers, texts and tensors (float(x) for a numpy number, str(p) for a Path), or allow its class"
              " with torch.serialization.add_safe_globals")  # fmt: skip
    told = [line for line in first.stderr.splitlines() if "a job resuming by itself refuses" in line]
    assert len(told) == 1, first.stderr[-3000:]  # at the first save only
    best = run_dir / "checkpoints" / "best-epoch=0-step=20.ckpt"
    assert re.fullmatch(  # numpy's own module path differs between its versions
        rf"checkpoint: {re.escape(str(best))} holds objects that a job resuming by itself refuses to load"
        rf" \(numpy\.[a-z_.]*scalar, numpy\.dtype\), so a preempted run would not go on: {re.escape(advice)}",
        told[0],
    ), told[0]

    again = run_train("fit", *full_epochs_args(experiment, run_dir, epochs=2), *numpy_numbers)
    errors = [line for line in again.stderr.splitlines() if line.startswith("error:")]
    assert again.returncode == 2 and len(errors) == 1 and advice in errors[0], again.stderr[-3000:]


def test_a_checkpoint_saved_on_a_gpu_resumes_on_a_machine_without_one(one_epoch, experiment, tmp_path, monkeypatch):
    # A GPU run's rank 0 saves tensors that torch tags "cuda:0"; saved here with that tag, the file is such a one.
    from_gpu = tmp_path / "from-gpu.ckpt"
    checkpoint = torch.load(one_epoch / "checkpoints" / "last.ckpt", weights_only=True)
    with monkeypatch.context() as patched:
        patched.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save(checkpoint, from_gpu)
    with pytest.raises(RuntimeError, match="CUDA"):
        torch.load(from_gpu, weights_only=True)  # where torch alone would put its tensors, this machine has no GPU

    run_dir = tmp_path / "run"
    result = run_train("fit", *full_epochs_args(experiment, run_dir, epochs=2), "--ckpt_path", str(from_gpu))
    assert result.returncode == 0, result.stderr[-3000:]
    assert load(run_dir / "checkpoints" / "last.ckpt")["global_step"] == 2 * STEPS_PER_EPOCH


def test_checkpoints_follow_the_umask_like_the_runs_other_files(one_epoch):
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in one_epoch.rglob("*") if path.is_file()}
    assert modes["last.ckpt"] == modes["config.yaml"] == 0o666 & ~current_umask()


def test_atomic_checkpoints_take_the_umask_they_are_written_under(tmp_path):
    from trainkit.checkpoints.io import AtomicCheckpointIO

    for umask, mode in ((0o022, 0o644), (0o027, 0o640), (0o077, 0o600)):
        previous = os.umask(umask)
        try:
            AtomicCheckpointIO().save_checkpoint({"state_dict": {}}, tmp_path / f"{umask:o}.ckpt")
        finally:
            os.umask(previous)
        assert stat.S_IMODE((tmp_path / f"{umask:o}.ckpt").stat().st_mode) == mode


def current_umask() -> int:
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def test_evaluation_and_debug_runs_leave_the_preemption_checkpoint_to_the_job(experiment, tmp_path):
    run_dir, marker, log = tmp_path / "run", tmp_path / "step-5", tmp_path / "train.log"
    fit = ["fit", *full_epochs_args(experiment, run_dir, epochs=1)]
    job = start([*fit, *paced(marker, at_step=5)], clean_env(), log)
    wait_for(marker, job, log)
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=60) == 143, log.read_text()[-4000:]
    preempted = run_dir / "checkpoints" / "preempted.ckpt"
    step, fingerprint = load(preempted)["global_step"], hashlib.sha256(preempted.read_bytes()).hexdigest()

    # What the README suggests between runs; each loads the preemption checkpoint (ckpt_path: last), but fast_dev_run,
    # which starts afresh.
    for command in (["test"], ["validate"], ["predict"], ["fit", "--trainer.fast_dev_run", "true"]):
        result = run_train(command[0], *fit[1:], *command[1:])
        assert result.returncode == 0, f"{command}: {result.stderr[-3000:]}"
        assert preempted.is_file(), f"{' '.join(command)} removed the checkpoint the job resumes from"
        assert hashlib.sha256(preempted.read_bytes()).hexdigest() == fingerprint, f"{command} replaced it"

    resumed = run_train(*fit)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"Restoring states from the checkpoint path at {preempted}" in resumed.stdout + resumed.stderr
    assert 5 < step < STEPS_PER_EPOCH
    assert load(run_dir / "checkpoints" / "last.ckpt")["global_step"] == STEPS_PER_EPOCH
    assert not preempted.exists(), "a fit that finished training removes it"


def test_an_explicit_damaged_checkpoint_is_refused_in_one_line(one_epoch, experiment, tmp_path):
    damaged = tmp_path / "damaged.ckpt"
    shutil.copy(one_epoch / "checkpoints" / "last.ckpt", damaged)
    damage(damaged, "a zeroed block")
    assert torch.load(damaged, weights_only=True)["global_step"] == STEPS_PER_EPOCH  # torch sees nothing wrong

    result = run_train("fit", *full_epochs_args(experiment, tmp_path / "run", epochs=2), "--ckpt_path", str(damaged))
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith(f"error: ckpt_path {damaged} is damaged:") and "checksum" in errors[0]
