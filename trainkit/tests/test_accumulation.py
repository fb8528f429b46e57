"""Gradient accumulation: the kit saves its checkpoints only after a batch in which the optimizer stepped.

Checkpoints keep no gradients: one saved after a batch that only added to them would lose what the batches
since the last step added, and a run resumed from it would train other weights (checkpoints/steps.py)."""

import signal

import pytest
from lightning.pytorch import Callback, Trainer

from trainkit.checkpoints.periodic import PeriodicCheckpoint
from trainkit.testing.contract import Run, YourCodeContract
from trainkit.testing.runs import exit_code, load, wait_for
from trainkit.testing.tiny import TinyClassifier, TinyDataModule

from .helpers import PROJECT_ROOT, clean_env, run_train, start

ACCUMULATE = 3


class Accumulating(YourCodeContract):
    """The tests' experiment, each optimizer step taking 3 batches: 8 steps an epoch, on 2 processes too."""

    project = PROJECT_ROOT
    run_args = ("--config", "configs/experiment.yaml", "--trainer.accumulate_grad_batches", str(ACCUMULATE),
                "--data.batch_size", "8")  # fmt: skip
    steps_per_epoch = 24  # batches, as the contract counts them


@pytest.mark.parametrize("processes", [1, 2], ids=["1 process", "2 processes"])
def test_sigterm_in_the_middle_of_an_accumulation_stops_at_its_step_and_resumes_bitwise(tmp_path, processes):
    """The drill's second SIGTERM comes as a platform's does, at any batch: mostly one that only accumulates,
    after which the run goes on to the batch that steps."""
    Accumulating().drill(tmp_path, "--trainer.devices", str(processes))


def test_sigterm_in_a_validation_in_the_middle_of_an_accumulation_stops_at_the_step_after_it(tmp_path):
    """Validation after every 5th batch, steps of 3 batches: a SIGTERM during the first validation skips the
    rest of it, and the run stops after batch 6, the step that ends that accumulation, not after batch 5."""
    contract = Accumulating()
    every_5th = ("--trainer.val_check_interval", "5")
    whole = contract.fit(tmp_path / "uninterrupted", *every_5th)
    assert whole.returncode == 0, whole.output[-4000:]
    run_dir, marker, log = tmp_path / "interrupted", tmp_path / "validating", tmp_path / "interrupted.log"
    command = ["fit", *contract.quick(run_dir, *every_5th)]
    pace_validation = ["--trainer.callbacks+=trainkit.testing.pacing.PaceValidation",
                       "--trainer.callbacks.marker", str(marker)]  # fmt: skip
    job = start([*command, *pace_validation], clean_env(), log)
    wait_for(marker, job, log)
    job.send_signal(signal.SIGTERM)
    assert exit_code(job, timeout=120, hang="SIGTERM did not end the run within 120 s") == 143, log.read_text()
    assert load(run_dir / "checkpoints" / "preempted.ckpt")["global_step"] == 2
    resumed = run_train(*command, env=clean_env(), timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert Run(run_dir, resumed.returncode, "").weights() == whole.weights()


class RecordSaves(Callback):
    def __init__(self) -> None:
        self.saved: list[tuple[int, int]] = []  # (batches trained, optimizer steps) at each save

    def on_save_checkpoint(self, trainer: Trainer, *args) -> None:
        self.saved.append((trainer.fit_loop.epoch_loop.batch_progress.current.processed, trainer.global_step))


def test_a_periodic_checkpoint_due_in_the_middle_of_an_accumulation_waits_for_its_step(tmp_path):
    """Its time always up, it falls due at every 10th batch (when the processes compare clocks); with steps of 3
    batches it saves after batches 12 and 21."""
    record = RecordSaves()
    periodic = PeriodicCheckpoint(every_minutes=1e-6, dirpath=str(tmp_path / "checkpoints"))
    trainer = Trainer(accelerator="cpu", max_epochs=1, limit_train_batches=24, limit_val_batches=0,
                      accumulate_grad_batches=ACCUMULATE, callbacks=[periodic, record], logger=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(TinyClassifier(), TinyDataModule(24 * 8, val_size=16, test_size=16, batch_size=8))
    assert record.saved == [(12, 4), (21, 7)]
