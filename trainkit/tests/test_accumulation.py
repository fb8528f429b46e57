"""Gradient accumulation: the kit saves its checkpoints only after a batch in which the optimizer stepped.

Checkpoints keep no gradients: one saved after a batch that only added to them would lose what the batches
since the last step added, and a run resumed from it would train other weights (checkpoints/steps.py)."""

import pytest
from lightning.pytorch import Callback, Trainer

from trainkit.checkpoints.periodic import PeriodicCheckpoint
from trainkit.testing.contract import YourCodeContract
from trainkit.testing.tiny import TinyClassifier, TinyDataModule

from .helpers import PROJECT_ROOT

ACCUMULATE = 3


class Accumulating(YourCodeContract):
    """The tests' experiment, each optimizer step taking 3 batches: 4 steps an epoch."""

    project = PROJECT_ROOT
    run_args = ("--config", "configs/experiment.yaml", "--trainer.accumulate_grad_batches", str(ACCUMULATE))
    steps_per_epoch = 12  # batches, as the contract counts them


@pytest.mark.parametrize("processes", [1, 2], ids=["1 process", "2 processes"])
def test_sigterm_in_the_middle_of_an_accumulation_stops_at_its_step_and_resumes_bitwise(tmp_path, processes):
    """The first SIGTERM is noted after the first epoch's last batch, so the next batch only accumulates: the
    run stops two batches later, once the optimizer steps."""
    Accumulating().drill(tmp_path, "--trainer.devices", str(processes))


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
