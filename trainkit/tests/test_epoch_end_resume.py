"""Killed around an epoch's end, a run resumes exactly: limited by epochs or by steps, with validation or without.

Lightning resumes a checkpoint saved at an epoch's last batch, or at the epoch's end, in ways that depend on
the run's limits (checkpoints/epoch_end.py). Each chain below kills a run at some moments in turn, as a hard
kill would (nothing runs after it), resumes each time from the checkpoint `ckpt_path: last` picks, and
compares what every step trained on, and the final weights, with a run that was never interrupted: for the
tests' tiny model and data module, and for Lightning's demo model with a shuffled loader of its own.
"""

import contextlib
import copy
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch.utils.data import DataLoader

from trainkit.checkpoints.epoch_end import ResumeFinishedEpochs
from trainkit.checkpoints.periodic import PeriodicCheckpoint
from trainkit.checkpoints.resume import newest_whole_checkpoint
from trainkit.checkpoints.rng_state import RNGStateCheckpoint
from trainkit.data.resumable import ResumableData
from trainkit.testing.runs import signal_at
from trainkit.testing.tiny import TinyClassifier, TinyDataModule
from trainkit.testing.training_samples import recorded

from .drills import group_is_gone, load, paced, start, wait_for, whole_epochs
from .helpers import PROJECT_ROOT, clean_env, quick_trainer_args, run_train

EPOCHS, BATCHES = 3, 18  # 144 samples in batches of 8

# Kills in turn, each a hook and the step done when the run is killed in it: before that hook's checkpoint
# callbacks (Lightning calls them after the others), so one saved in that hook is not saved.
CHAINS = {
    "before-the-last-batchs-save-then-in-the-next-epoch": [("on_train_batch_end", 18), ("on_train_batch_end", 19)],
    # Resumed from periodic.ckpt saved after the last batch's step, before last.ckpt: the way to 55 steps.
    "before-the-epochs-last-ckpt-then-in-the-next-epoch": [("on_train_epoch_end", 18), ("on_train_batch_end", 20)],
    # Resumed from last.ckpt, saved at the epoch's end.
    "at-the-next-epochs-start-then-after-its-first-batch": [("on_train_epoch_start", 18), ("on_train_batch_end", 19)],
    "before-the-next-epochs-first-batch-then-its-seventh": [("on_train_batch_start", 18), ("on_train_batch_start", 24)],
    "after-the-next-epochs-first-batch-then-mid-epoch": [("on_train_batch_start", 19), ("on_train_batch_start", 25)],
    "in-validation-then-after-it": [("on_validation_start", 18), ("on_validation_end", 36), ("on_train_batch_end", 37)],
}
LIMITS = {"by-epochs": {"max_epochs": EPOCHS}, "by-steps": {"max_epochs": -1, "max_steps": EPOCHS * BATCHES}}


class Killed(BaseException):
    """A hard kill: nothing of the run runs after it."""


class KillAt(Callback):
    def __init__(self, hook: str, step: int) -> None:
        self.step = step
        self.fired = False
        setattr(self, hook, self._kill)

    def _kill(self, trainer: Trainer, *args) -> None:
        if trainer.global_step == self.step and not trainer.sanity_checking:
            self.fired = True
            raise Killed


class RecordSteps(Callback):
    """What each step trained on: the sums of its images, in batch order, and the learning rate."""

    def __init__(self) -> None:
        self.trained: dict[int, list[float]] = {}

    def on_train_batch_start(self, trainer: Trainer, pl_module, batch, batch_idx: int) -> None:
        inputs = batch[0] if isinstance(batch, list | tuple) else batch
        learning_rate = trainer.optimizers[0].param_groups[0]["lr"]
        self.trained[trainer.global_step] = [*inputs.flatten(1).sum(1).tolist(), learning_rate]


class OwnLoaders(BoringModel):
    """Lightning's demo model, with a training loader of its own that shuffles, and no data module."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, BATCHES * 8), batch_size=8, shuffle=True)


MODELS = {
    "tiny-data-module": lambda: (
        TinyClassifier(),
        TinyDataModule(BATCHES * 8, val_size=16, test_size=16, batch_size=8),
    ),
    "own-loaders": lambda: (OwnLoaders(), None),
}


def fit(run_dir: Path, model: str, limits: dict, validate: bool, kill: KillAt | None = None) -> tuple[Trainer, dict]:
    """A fit in this process with the kit's checkpoints (periodic every step), resumed as `ckpt_path: last` would."""
    seed_everything(0, verbose=False)  # the demo's data is drawn when its loader is made
    record = RecordSteps()
    checkpoints = run_dir / "checkpoints"
    callbacks = [
        ModelCheckpoint(dirpath=checkpoints, filename="last", enable_version_counter=False),
        PeriodicCheckpoint(every_n_steps=1, dirpath=str(checkpoints)),
        ResumableData(),
        RNGStateCheckpoint(),
        record,
        ResumeFinishedEpochs(),  # the command line adds it
        *([kill] if kill else []),
    ]
    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=callbacks, default_root_dir=run_dir, num_sanity_val_steps=0,
                      limit_val_batches=2 if validate else 0, **limits)  # fmt: skip
    resume_from = newest_whole_checkpoint([checkpoints]) if checkpoints.is_dir() else None
    with contextlib.suppress(Killed):
        trainer.fit(*MODELS[model](), ckpt_path=resume_from)
    return trainer, record.trained


CASES = [
    pytest.param(model, chain, by, validate, id=f"{model}-{name}-{by}-{'' if validate else 'no-'}validation")
    for model in MODELS
    for name, chain in CHAINS.items()
    for by in LIMITS
    for validate in (True, False)
    if validate or not any(hook.startswith("on_validation") for hook, _ in chain)
]

Uninterrupted = tuple[dict[int, list[float]], dict[str, torch.Tensor]]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Callable[[str, str, bool], Uninterrupted]:
    """The run never killed, of each model, limit and validation: what its steps trained on, its final weights.

    Run once for all the chains that compare with it (a fit saves a checkpoint at every step)."""
    runs: dict[tuple[str, str, bool], Uninterrupted] = {}

    def run(model: str, by: str, validate: bool) -> Uninterrupted:
        if (model, by, validate) not in runs:
            trainer, trained = fit(tmp_path_factory.mktemp("uninterrupted"), model, LIMITS[by], validate)
            runs[model, by, validate] = trained, trainer.lightning_module.state_dict()
        return runs[model, by, validate]

    return run


@pytest.mark.parametrize(("model", "chain", "by", "validate"), CASES)
def test_a_run_killed_around_an_epochs_end_trains_what_an_uninterrupted_one_does(model, chain, by, validate,
                                                                                 uninterrupted, tmp_path):  # fmt: skip
    expected, weights = uninterrupted(model, by, validate)
    assert sorted(expected) == list(range(EPOCHS * BATCHES))

    trained: dict[int, list[float]] = {}
    for kill in [*(KillAt(*moment) for moment in chain), None]:
        trainer, steps = fit(tmp_path, model, LIMITS[by], validate, kill)
        assert kill is None or kill.fired, f"the run was not killed {kill.step} steps in"
        trained.update(steps)  # a step trained again after a resume replaces the lost one
    assert trainer.global_step == EPOCHS * BATCHES, "the resumed run trained another number of steps"
    assert trained == expected, "a resumed run trained on other samples, or at another learning rate"
    for name, tensor in weights.items():
        assert torch.equal(tensor, trainer.lightning_module.state_dict()[name]), f"{name} differs after resuming"


@pytest.mark.parametrize("checkpoint", [{"state_dict": {}}, {"loops": {"fit_loop": {"epoch_progress": {"total": {}}}}}],
                         ids=["without-loops", "loops-of-another-layout"])  # fmt: skip
def test_a_checkpoint_without_the_loops_it_knows_is_left_as_it_is(checkpoint):
    as_saved = copy.deepcopy(checkpoint)
    ResumeFinishedEpochs().on_load_checkpoint(Trainer(logger=False), TinyClassifier(), checkpoint)
    assert checkpoint == as_saved


@pytest.mark.slow
def test_sigterm_at_an_epochs_last_batch_then_mid_epoch_then_the_same_command_trains_the_same_weights(
    experiment, tiny_chunks, tmp_path
):
    """Preempted just after the last batch of the first epoch (the preemption checkpoint is saved there), then
    in the middle of the second by a SIGTERM to the job's first process (as Kubernetes and Docker send it): the
    command run again trains, through train.py, on the samples a run never stopped trains on, in the same order,
    to the same weights. Streamed from chunks by 2 loader workers and limited by steps; the contract's drills
    (test_your_code_contract.py) stop in-memory data, limited by epochs, the same way."""
    # The tiny data's 576 training images in batches of 32: 18 an epoch.
    data = ["--data", str(PROJECT_ROOT / "configs" / "data" / "streaming_images.yaml"),
            "--data.input_dir", str(tiny_chunks), "--data.batch_size", "32", "--data.num_workers", "2"]  # fmt: skip
    limit = ["--trainer.max_epochs", "-1", "--trainer.max_steps", str(2 * BATCHES)]

    def args(run: str, *extra: str) -> list[str]:
        return ["fit", "--config", str(experiment), *quick_trainer_args(tmp_path / run), *whole_epochs(2), *data,
                *limit, "--trainer.callbacks+=trainkit.testing.training_samples.RecordTrainingSamples",
                "--trainer.callbacks.out_dir", str(tmp_path / run / "samples"), *extra]  # fmt: skip

    uninterrupted = run_train(*args("uninterrupted"))
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-4000:]
    checkpoints = tmp_path / "resumed" / "checkpoints"
    at_epoch_end = run_train(*args("resumed", *signal_at(BATCHES)))
    assert at_epoch_end.returncode == 143, at_epoch_end.stderr[-4000:]
    assert load(checkpoints / "preempted.ckpt")["global_step"] == BATCHES

    # Preempted again early in the next epoch: resumed from the first preemption, Lightning alone would count that
    # epoch as not started yet, and the next resume would train its first batches twice.
    marker, log = tmp_path / "mid-epoch", tmp_path / "interrupted.log"
    job = start(args("resumed", *paced(marker, at_step=BATCHES + 2)), clean_env(), log)
    wait_for(marker, job, log)
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=60) == 143, log.read_text()[-4000:]
    time.sleep(1)
    assert group_is_gone(job), "a process of the job is still running"
    preempted = load(checkpoints / "preempted.ckpt")
    assert BATCHES < preempted["global_step"] < 2 * BATCHES, "the interruption must land mid-epoch"
    assert preempted["optimizer_states"] and preempted["lr_schedulers"] and preempted["loops"]
    assert any("RNGStateCheckpoint" in key for key in preempted["callbacks"])
    assert not [path for path in checkpoints.iterdir() if path.name.startswith(".")], "temporary files left"

    resumed = run_train(*args("resumed"))
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-4000:]
    assert "preempted.ckpt" in output and "not resumable" not in output
    assert not (checkpoints / "preempted.ckpt").exists()
    assert recorded(tmp_path / "resumed" / "samples", 0) == recorded(tmp_path / "uninterrupted" / "samples", 0)
    expected, actual = (load(tmp_path / run / "checkpoints" / "last.ckpt") for run in ("uninterrupted", "resumed"))
    assert actual["global_step"] == expected["global_step"] == 2 * BATCHES
    for name, tensor in expected["state_dict"].items():
        assert torch.equal(tensor, actual["state_dict"][name]), f"{name} differs after resuming"
