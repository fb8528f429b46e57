"""Day-to-day use: composed configs, another logger, what a run records, predictions, log-friendly progress."""

import csv
import logging
import re
import statistics
import subprocess
from importlib import metadata

import pytest
import torch
import yaml
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger

from trainkit.cli import DEFAULTS
from trainkit.testing.runs import signal_at
from trainkit.tracking.predictions import PredictionWriter
from trainkit.tracking.progress import PlainProgress

from .helpers import EXPERIMENT, PROJECT_ROOT, quick_run_args, quick_trainer_args, run_train


def test_experiment_configs_compose_in_order(experiment, tmp_path):
    # An experiment on top of the default one, only what differs (as configs/exp/bigger.yaml is).
    bigger = tmp_path / "bigger.yaml"
    bigger.write_text("trainer:\n  max_epochs: 10\nmodel:\n  hidden: 64\n  lr: 0.0005\ndata:\n  batch_size: 256\n")
    printed = run_train("fit", "--config", str(experiment), "--config", str(bigger), "--print_config")
    assert printed.returncode == 0, printed.stderr[-3000:]
    config = yaml.safe_load(printed.stdout)
    model = config["model"]["init_args"]
    assert model["hidden"] == 64 and config["trainer"]["max_epochs"] == 10  # from bigger.yaml
    assert config["data"]["init_args"]["batch_size"] == 256
    assert model["lr"] == 0.0005
    assert model["dropout"] == 0.3  # from model/tiny_model.yaml, which the experiment names
    experiment_file = yaml.safe_load(EXPERIMENT.read_text())
    assert config["best_checkpoint"] == experiment_file["best_checkpoint"]  # kept from experiment.yaml
    assert config["seed_everything"] == 42
    # The kit's defaults, under the experiment: its callbacks and its logger, with the experiment's project.
    assert any(callback["class_path"].endswith(".PreemptionCheckpoint") for callback in config["trainer"]["callbacks"])
    logger = config["trainer"]["logger"]
    assert logger["class_path"] == "trainkit.tracking.wandb_logger.WandbLogger"
    assert logger["init_args"]["project"] == experiment_file["trainer"]["logger"]["init_args"]["project"]


def test_csv_logger_records_config_code_version_and_cluster_setup(experiment, tmp_path):
    run_dir = tmp_path / "run"
    result = run_train("fit", *quick_run_args(experiment, run_dir), "--config", "configs/loggers/csv.yaml")
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (run_dir / "wandb").exists()
    version_dir = run_dir / "lightning_logs" / "version_0"
    assert "val/acc" in (version_dir / "metrics.csv").read_text()
    recorded = yaml.safe_load((version_dir / "hparams.yaml").read_text())
    assert recorded["config"]["model"]["init_args"]["hidden"] == 32
    assert recorded["config"]["trainer"]["default_root_dir"] == str(run_dir)
    assert recorded["counts"] == {"num_nodes": 1, "devices_per_node": 1, "world_size": 1}
    assert recorded["environment"]["platform"] == "local"
    assert recorded["versions"]["lightning"] == metadata.version("lightning")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PROJECT_ROOT, capture_output=True, text=True)
    assert recorded["git"]["commit"] == (commit.stdout.strip() if commit.returncode == 0 else None)
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["trainer"]["logger"]["class_path"].endswith("CSVLogger")


def test_logger_switches_with_one_flag(experiment, tmp_path):
    run_dir = tmp_path / "run"
    result = run_train("fit", *quick_run_args(experiment, run_dir), "--config", "configs/loggers/tensorboard.yaml")
    assert result.returncode == 0, result.stderr[-3000:]
    assert list(run_dir.glob("lightning_logs/version_0/events.out.tfevents.*"))


def test_predict_writes_a_csv_a_person_can_open(experiment, tmp_path):
    run_dir = tmp_path / "run"
    assert run_train("fit", *quick_run_args(experiment, run_dir), "--trainer.max_epochs", "2").returncode == 0
    predicted = run_train("predict", *quick_run_args(experiment, run_dir), "--ckpt_path", "last")
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    with (run_dir / "predictions.csv").open() as file:
        rows = list(csv.DictReader(file))
    assert len(rows) == 160  # the whole test split
    assert sorted(int(row["index"]) for row in rows) == list(range(160))
    assert all(0 < float(row["confidence"]) <= 1 for row in rows)
    assert sum(row["predicted"] == row["label"] for row in rows) > 0.5 * len(rows)
    # On 2 processes each writes its part, and the 1-process file of before is gone: it would read as this one's.
    shared = run_train("predict", *quick_run_args(experiment, run_dir), "--ckpt_path", "last", "--trainer.devices", "2")
    assert shared.returncode == 0, shared.stderr[-3000:]
    parts = sorted(path.name for path in run_dir.glob("predictions*.csv"))
    assert parts == ["predictions-rank0.csv", "predictions-rank1.csv"], parts
    indices = [int(row["index"]) for part in parts for row in csv.DictReader((run_dir / part).open())]
    assert sorted(set(indices)) == list(range(160))  # the whole test split (DDP's sampler may repeat one to even out)


def test_ckpt_path_best_finds_the_best_checkpoint_of_an_earlier_fit(experiment, tmp_path):
    # Lightning knows "best" only in the process that ran fit; the command line finds it in checkpoints/.
    run_dir = tmp_path / "run"
    refused = run_train("test", *quick_run_args(experiment, run_dir), "--ckpt_path", "best")
    assert refused.returncode == 2, refused.stderr[-3000:]
    checkpoints = (run_dir / "checkpoints").resolve()
    assert f"error: ckpt_path best: no checkpoints in {checkpoints}; run fit first or pass a checkpoint file" in (
        refused.stderr.splitlines()
    )
    assert run_train("fit", *quick_run_args(experiment, run_dir), "--trainer.max_epochs", "2").returncode == 0
    (best,) = checkpoints.glob("best-*.ckpt")
    other_metric = run_train("test", *quick_run_args(experiment, run_dir), "--ckpt_path", "best",
                             "--best_checkpoint.monitor", "val/loss", "--best_checkpoint.mode", "min")  # fmt: skip
    assert other_metric.returncode == 2, other_metric.stderr[-3000:]
    assert (
        f"error: ckpt_path best: {checkpoints / 'last.ckpt'} records no best checkpoint by val/loss (min), only by"
        " val/acc (max): give --best_checkpoint.monitor val/acc --best_checkpoint.mode max as the run did, or pass a"
        " checkpoint file"
    ) in other_metric.stderr.splitlines()
    moved = tmp_path / "moved"  # as a run directory copied off a cluster: the recorded path is gone
    run_dir.rename(moved)
    tested = run_train("test", *quick_run_args(experiment, moved), "--ckpt_path", "best")
    assert tested.returncode == 0, tested.stderr[-3000:]
    restored = f"Restoring states from the checkpoint path at {moved.resolve() / 'checkpoints' / best.name}"
    assert restored in tested.stdout + tested.stderr
    assert "multiple `ModelCheckpoint`" not in tested.stderr  # Lightning's warning, were it given "best"


def test_output_to_a_file_gets_log_lines_not_a_progress_bar(experiment, tmp_path):
    args = quick_run_args(experiment, tmp_path / "run")
    assert args[-2:] == ["--trainer.enable_progress_bar", "false"]
    result = run_train("fit", *args[:-2], "--trainer.log_every_n_steps", "2")  # output captured: not a terminal
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"^epoch 1/1 step 2/4 lr-Adam=0.0100 train/loss=\S+ \(", result.stderr, re.MULTILINE)
    assert "epoch 1/1 val/acc=" in result.stderr
    assert "it/s" not in result.stdout + result.stderr  # what Lightning's progress bars show


def test_with_gradient_accumulation_a_progress_line_shows_the_batch_and_the_optimizer_step(caplog):
    """The epoch's length counts batches; a checkpoint, the `SIGTERM:` line and the logger count optimizer steps."""
    trainer = Trainer(max_epochs=1, limit_train_batches=8, limit_val_batches=0, accumulate_grad_batches=2,
                      callbacks=[PlainProgress(every_n_steps=2)], logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="trainkit.tracking.progress"):
        trainer.fit(BoringModel())
    where = [
        " ".join(record.getMessage().split()[:6])
        for record in caplog.records
        if record.name == PlainProgress.__module__
    ]
    assert where == ["epoch 1/1 batch 4/8 (step 2)", "epoch 1/1 batch 8/8 (step 4)"], where


class WarmsUpEachStep(BoringModel):
    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=8)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def test_the_learning_rate_a_progress_line_shows_is_the_one_of_its_step_under_a_per_step_schedule(tmp_path, caplog):
    """The defaults' LearningRateMonitor, as it is configured: a line showed the rate of its epoch's start."""
    (monitor,) = [callback for callback in yaml.safe_load(DEFAULTS.read_text())["trainer"]["callbacks"]
                  if callback["class_path"].endswith("LearningRateMonitor")]  # fmt: skip
    trainer = Trainer(max_epochs=1, limit_train_batches=8, limit_val_batches=0, log_every_n_steps=2,
                      callbacks=[LearningRateMonitor(**monitor["init_args"]), PlainProgress(every_n_steps=2)],
                      logger=CSVLogger(tmp_path), enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False)  # fmt: skip
    with caplog.at_level(logging.INFO, logger=PlainProgress.__module__):
        trainer.fit(WarmsUpEachStep())
    shown = [float(re.search(r"lr-SGD=(\S+)", record.getMessage())[1]) for record in caplog.records
             if record.name == PlainProgress.__module__]  # fmt: skip
    # The rate the line's step trained at, logged as it began: LinearLR's 0.01 + 0.01125 x (step - 1).
    assert shown == pytest.approx([0.02125, 0.04375, 0.06625, 0.08875], abs=1e-4), shown


def test_a_run_resumed_mid_epoch_shows_the_speed_of_its_own_steps(experiment, tmp_path):
    """Lightning starts no epoch where a run resumes mid-epoch: its first line counts from the checkpoint's step."""
    args = [
        "fit",
        *quick_run_args(experiment, tmp_path / "run")[:-2],
        "--data.batch_size",
        "8",
        "--trainer.limit_train_batches",
        "1.0",
        "--trainer.max_steps",
        "52",
        "--trainer.log_every_n_steps",
        "2",
    ]
    stopped = run_train(*args, *signal_at(40))  # 72 steps an epoch
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    resumed = run_train(*args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rates = [float(rate) for rate in re.findall(r"^epoch 1/1 step \d+/72 .* \((\S+) steps/s\)$", resumed.stderr, re.M)]
    assert len(rates) >= 5, resumed.stderr[-3000:]
    # Counted from step 0, the first would be 20 times the others or more.
    assert rates[0] < 4 * statistics.median(rates[1:]), rates


def test_progress_and_the_best_checkpoint_follow_any_metric_names_and_several_validation_loaders(experiment, tmp_path):
    # An endless stream, bounded by max_steps alone: no number of epochs or of batches to show.
    run_dir = tmp_path / "run"
    stream = ["--model", "tasks.sines.PhaseReader", "--data", "tasks.sines.Sines",
              "--best_checkpoint.monitor", "val_mse/dataloader_idx_0",
              "--trainer.max_epochs", "-1", "--trainer.max_steps", "8", "--trainer.limit_train_batches", "1.0",
              "--trainer.val_check_interval", "4", "--trainer.log_every_n_steps", "2"]  # fmt: skip
    result = run_train("fit", "--config", str(experiment), *quick_trainer_args(run_dir)[:-2], *stream)  # no bar
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("epoch ")]
    training = [line for line in lines if "train_mse" in line]
    assert [re.sub(r" lr-AdamW=\S+ train_mse=\S+ \(.*", "", line) for line in training] == [
        f"epoch 1 step {step}" for step in (2, 4, 6, 8)
    ], lines
    validations = [line for line in lines if "val_mse" in line]
    assert len(validations) == 2 and all(
        re.fullmatch(r"epoch 1 val_mse/dataloader_idx_0=\S+ val_mse/dataloader_idx_1=\S+", line) for line in validations
    ), lines
    assert all("val_mse" not in line for line in training), lines
    # Lightning keeps no metrics of a sanity check over several loaders: that is not a missing metric.
    assert "best_checkpoint.monitor" not in result.stderr
    assert len(list((run_dir / "checkpoints").glob("best-*.ckpt"))) == 1


def test_predict_writes_what_any_model_returns(experiment, tmp_path):
    # Lightning's demo model predicts a tensor of two numbers per sample from loaders of its own.
    run_dir = tmp_path / "run"
    demo = ["--model", "lightning.pytorch.demos.boring_classes.BoringModel", "--data", "null"]
    args = ["--config", str(experiment), *quick_trainer_args(run_dir), *demo]
    assert run_train("fit", *args).returncode == 0
    predicted = run_train("predict", *args, "--ckpt_path", "last")
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    with (run_dir / "predictions.csv").open() as file:
        rows = list(csv.DictReader(file))
    assert len(rows) == 64 and list(rows[0]) == ["index", "prediction"]  # RandomDataset(32, 64)
    assert all(len(row["prediction"].split()) == 2 for row in rows)


@pytest.mark.parametrize(
    ("returned", "header", "first_row"),
    [
        (torch.tensor([0.5, 0.25]), ["index", "prediction"], ["10", "0.5"]),
        ({"text": ["ab", "cd"], "logits": torch.ones(2, 3)}, ["index", "text", "logits"], ["10", "ab", "1.0 1.0 1.0"]),
        ({"loss": torch.tensor(0.5), "id": [7, 8]}, ["index", "loss", "id"], ["10", "0.5", "7"]),
        ((torch.tensor([3, 1]), torch.tensor([0.9, 0.6])), ["index", "prediction_0", "prediction_1"],
         ["10", "3", "0.9"]),
    ],
    ids=["a tensor", "texts and logits", "a value for the whole batch", "a tuple"],
)  # fmt: skip
def test_the_prediction_writer_writes_a_column_per_returned_value(tmp_path, returned, header, first_row):
    writer = PredictionWriter(str(tmp_path))
    trainer = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    writer.on_predict_epoch_start(trainer, None)
    writer.write_on_batch_end(trainer, None, returned, [10, 11], None, 0, 0)
    writer.on_predict_epoch_end(trainer, None)
    with (tmp_path / "predictions.csv").open() as file:
        rows = list(csv.reader(file))
    assert rows[0] == header and rows[1] == first_row and len(rows) == 3


def test_the_prediction_writer_names_a_value_with_another_number_of_samples_than_the_batch(tmp_path):
    writer = PredictionWriter(str(tmp_path))
    with pytest.raises(ValueError, match=r"^predict_step returned 'scores' with 3 values for a batch of 2 samples"):
        writer.write_on_batch_end(None, None, {"scores": torch.ones(3)}, [10, 11], None, 0, 0)
