"""Checkpoints written in the background (`checkpoint_saving.asynchronous`): training waits only for the copy.

The copy must be a real one: training changes the weights in place as soon as a save returns, so a
checkpoint written from the live tensors would hold a later step's weights, or a mix of steps.
"""

import hashlib
import json
import re
import signal
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.distributed.tensor import DTensor

from trainkit.checkpoints.io import AtomicCheckpointIO, CheckpointNotWritten
from trainkit.checkpoints.saving import CheckpointSavingSettings, wait_for_checkpoints
from trainkit.checkpoints.stored import StoredCheckpointIO
from trainkit.store.object_store import FsspecStore

from .drills import exit_code, full_epochs_args, last_words, load, paced, start, wait_for, with_periodic
from .helpers import clean_env, quick_run_args, run_train

ASYNCHRONOUS = ["--checkpoint_saving.asynchronous", "true"]


class SlowDisk(Callback):
    """Every checkpoint write starts `seconds` late, as on a slow network disk: training goes on meanwhile."""

    def __init__(self, seconds: float = 1.0) -> None:
        self.seconds = seconds

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        io = trainer.strategy.checkpoint_io
        write = io._write

        def late_write(checkpoint: dict[str, Any], path: Path) -> None:
            time.sleep(self.seconds)
            write(checkpoint, path)

        io._write = late_write


class SaveAndChangeWeights(Callback):
    """At step `at_step`, save `out_dir/at-step-N.ckpt`, then at once change every weight in place (+1000), as the
    next optimizer step does, only more. `out_dir/at-step-N.json` holds the digests of the weights as saved and
    as changed."""

    def __init__(self, out_dir: str, at_step: int = 3) -> None:
        self.out_dir = Path(out_dir)
        self.at_step = at_step

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.global_step != self.at_step:
            return
        saved = digests(pl_module.state_dict())
        trainer.save_checkpoint(self.out_dir / f"at-step-{self.at_step}.ckpt")
        with torch.no_grad():
            for parameter in pl_module.parameters():
                parameter.add_(1000.0)
        record = {"saved": saved, "changed": digests(pl_module.state_dict())}
        (self.out_dir / f"at-step-{self.at_step}.json").write_text(json.dumps(record))


def digests(weights: dict[str, torch.Tensor]) -> dict[str, str]:
    """Each tensor's digest; a sharded one's (a DTensor) of the whole tensor, gathered from every process."""
    wholes = {name: tensor.full_tensor() if isinstance(tensor, DTensor) else tensor for name, tensor in weights.items()}
    return {name: hashlib.sha256(tensor.cpu().numpy().tobytes()).hexdigest() for name, tensor in wholes.items()}


def save_and_change(out_dir: Path, at_step: int = 3) -> list[str]:
    return [
        "--trainer.callbacks+=tests.test_async_saving.SaveAndChangeWeights",
        "--trainer.callbacks.out_dir", str(out_dir),
        "--trainer.callbacks.at_step", str(at_step),
    ]  # fmt: skip


def slow_disk(seconds: float = 1.0) -> list[str]:
    return ["--trainer.callbacks+=tests.test_async_saving.SlowDisk",
            "--trainer.callbacks.seconds", str(seconds)]  # fmt: skip


@pytest.mark.slow
def test_an_async_checkpoint_holds_the_weights_of_its_step_though_training_changed_them(experiment, tmp_path):
    out = tmp_path / "saves"
    out.mkdir()
    args = ["fit", *quick_run_args(experiment, tmp_path / "run"), "--trainer.devices", "1", *ASYNCHRONOUS,
            "--checkpoint_saving.grace_seconds", "0.5", *slow_disk(1.0), *save_and_change(out, at_step=3)]  # fmt: skip
    result = run_train(*args)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]

    record = json.loads((out / "at-step-3.json").read_text())
    checkpoint = load(out / "at-step-3.ckpt")
    assert checkpoint["global_step"] == 3
    assert set(record["saved"].values()).isdisjoint(record["changed"].values()), "the weights did not change"
    assert digests(checkpoint["state_dict"]) == record["saved"]  # not the changed ones, nor a mix

    # Training waited for the copy only; the write (1 s late on the slow disk) went on in the background.
    report = re.search(r"checkpoint at-step-3\.ckpt: training waited ([\d.]+) s, written in ([\d.]+) s", output)
    assert report, output[-4000:]
    assert float(report[1]) < 1.0 <= float(report[2])
    warnings = re.findall(r"saving \S+ took [\d.]+ s, longer than the 0.5 s the platform gives", output)
    assert len(warnings) == 1, output[-4000:]  # once a run, not at every save
    last = load(tmp_path / "run" / "checkpoints" / "last.ckpt")  # the last write was waited for at the end
    assert last["global_step"] == 4


@pytest.mark.slow
def test_sigterm_with_async_saving_writes_the_preemption_checkpoint_before_exiting_143(experiment, tmp_path):
    run_dir, marker, log = tmp_path / "run", tmp_path / "step-5", tmp_path / "train.log"
    checkpoints = run_dir / "checkpoints"
    config = with_periodic(experiment, every_n_steps=2)  # a periodic checkpoint being written at the signal
    args = ["fit", *full_epochs_args(config, run_dir), "--trainer.devices", "1", *ASYNCHRONOUS, *slow_disk(1.0),
            *paced(marker, at_step=5)]  # fmt: skip
    job = start(args, clean_env(), log)
    wait_for(marker, job, log)
    job.send_signal(signal.SIGTERM)
    code = exit_code(job, timeout=120, hang="the job hung after SIGTERM")
    output = log.read_text()
    assert code == 143, output[-4000:]

    step = load(checkpoints / "preempted.ckpt")["global_step"]
    assert step > 5
    said = f"SIGTERM: saved {checkpoints / 'preempted.ckpt'} at step {step}; exiting (143)"
    assert last_words(log) == said, output[-4000:]
    # Written, not only handed to the background, before the process said so.
    written = re.search(r"checkpoint preempted\.ckpt: training waited [\d.]+ s, written in [\d.]+ s", output)
    assert written and written.start() < output.index(said), output[-4000:]
    assert load(checkpoints / "periodic.ckpt")["global_step"] <= step
    assert not [path for path in checkpoints.iterdir() if path.name.startswith(".")], "temporary files left"


@pytest.mark.slow
def test_a_failed_background_write_ends_the_run_in_one_line_at_the_next_save(experiment, tmp_path):
    out = tmp_path / "saves"
    (out / "at-step-2.ckpt").mkdir(parents=True)  # a directory in the way: the write's rename fails
    args = ["fit", *quick_run_args(experiment, tmp_path / "run"), "--trainer.devices", "1", *ASYNCHRONOUS,
            *save_and_change(out, at_step=2)]  # fmt: skip
    result = run_train(*args)
    assert result.returncode == 74, result.stderr[-4000:]  # exit_codes.CANNOT_WRITE
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [result.stderr.strip().splitlines()[-1]], result.stderr[-4000:]
    assert errors[0].startswith(f"error: could not write checkpoint {out / 'at-step-2.ckpt'}: Is a directory;")
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "checkpoints" / "last.ckpt").exists(), "it trained on to the end"
    assert not [path for path in out.iterdir() if path.name.startswith(".")], "temporary files left"


def asynchronous_io() -> AtomicCheckpointIO:
    return AtomicCheckpointIO(CheckpointSavingSettings(asynchronous=True))


def test_a_failed_background_write_is_raised_once_by_the_next_save_wait_or_teardown(tmp_path):
    in_the_way = tmp_path / "in-the-way.ckpt"
    in_the_way.mkdir()
    checkpoint = {"state_dict": {"weight": torch.ones(2)}, "global_step": 1}

    io = asynchronous_io()
    io.save_checkpoint(checkpoint, in_the_way)  # returns: the write fails in the background
    with pytest.raises(CheckpointNotWritten, match="Is a directory"):
        io.save_checkpoint(checkpoint, tmp_path / "next.ckpt")
    io.teardown()  # told already: not again
    assert not (tmp_path / "next.ckpt").exists()

    io = asynchronous_io()
    io.save_checkpoint(checkpoint, in_the_way)
    told = re.escape(f"could not write checkpoint {in_the_way}: Is a directory")
    with pytest.raises(CheckpointNotWritten, match=told):
        io.teardown()

    io = asynchronous_io()
    io.save_checkpoint(checkpoint, in_the_way)
    with pytest.raises(CheckpointNotWritten):
        wait_for_checkpoints(SimpleNamespace(strategy=SimpleNamespace(checkpoint_io=io)))
    assert not [path for path in tmp_path.iterdir() if path.name.startswith(".")], "temporary files left"


def test_waiting_for_checkpoints_waits_for_the_strategy_too_and_raises_the_first_failure(tmp_path):
    waited = []

    class Strategy:
        checkpoint_io = asynchronous_io()

        def wait_for_checkpoints(self) -> None:
            waited.append("strategy")
            raise CheckpointNotWritten(tmp_path / "sharded.ckpt", "No space left on device")

    (tmp_path / "in-the-way.ckpt").mkdir()
    Strategy.checkpoint_io.save_checkpoint({"global_step": 1}, tmp_path / "in-the-way.ckpt")
    with pytest.raises(CheckpointNotWritten, match=r"in-the-way\.ckpt: Is a directory"):
        wait_for_checkpoints(SimpleNamespace(strategy=Strategy()))
    assert waited == ["strategy"]  # waited for though the checkpoint IO's write had failed


def test_stored_checkpoints_upload_each_version_once_it_is_written(tmp_path):
    store = FsspecStore(f"file://{tmp_path}/store")
    io = StoredCheckpointIO(store, keep=5, saving=CheckpointSavingSettings(asynchronous=True))
    weight = torch.zeros(3)
    for step in (1, 2, 3):
        weight.fill_(step)
        io.save_checkpoint({"state_dict": {"weight": weight}, "global_step": step}, tmp_path / "job" / "periodic.ckpt")
        weight.fill_(-1)  # training goes on: the version being written and uploaded keeps its step's weights
    io.wait()
    for step in (1, 2, 3):
        stored = torch.load(tmp_path / "store" / "checkpoints" / f"periodic-step={step}.ckpt", weights_only=True)
        assert stored["state_dict"]["weight"].tolist() == [step] * 3
    assert json.loads((tmp_path / "store" / "latest").read_text())["step"] == 3
    assert not [path.name for path in (tmp_path / "job").iterdir() if path.name != "periodic.ckpt"]
