"""`train.py` itself, run as a user runs it."""

import os
import re
import subprocess
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import yaml
from jsonargparse import Namespace
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import EarlyStopping
from lightning.pytorch.strategies import StrategyRegistry
from torch import Tensor
from torch.utils.data import DataLoader

from trainkit.checkpoints.fit import stopped_early
from trainkit.cli import DEFAULTS, ProjectCLI
from trainkit.cluster.settings import ClusterSettings
from trainkit.run.errors import ConfigError
from trainkit.strategies.ddp import WatchedDDPStrategy
from trainkit.strategies.timeouts import use_timeouts_for_ddp, watch_ddp_configured_by_class
from trainkit.testing.configs import print_config
from trainkit.testing.runs import signal_at
from trainkit.testing.tiny import TinyDataModule
from trainkit.tracking.record import config_changes

from .helpers import PROJECT_ROOT, clean_env, quick_run_args, quick_trainer_args, run_train


def test_fit_trains_saves_checkpoints_and_reruns_in_the_same_directory(experiment, tmp_path):
    run_dir = tmp_path / "run"
    first = run_train("fit", *quick_run_args(experiment, run_dir))
    assert first.returncode == 0, first.stderr[-3000:]
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert (run_dir / "config.yaml").is_file()
    assert "[local] node_rank=0 local_rank=0 global_rank=0 world_size=1" in first.stderr

    # The same command again (a restarted job) must not refuse because of the first run's files; one that trains
    # longer, with another learning rate, is told what differs from the config that trained the checkpoint.
    longer = ["--trainer.max_epochs", "2", "--model.lr", "0.05"]
    second = run_train("fit", *quick_run_args(experiment, run_dir), *longer)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "Restoring states from the checkpoint" in second.stdout + second.stderr
    last = run_dir / "checkpoints" / "last.ckpt"
    assert resume_lines(second) == [f"resume: going on from {last}, saved at step 4 with 1 epoch finished",
                                    f"resume: {last} was trained with another config: model.init_args.lr 0.05"
                                    " (was 0.01), trainer.max_epochs 2 (was 1)"], second.stderr[-3000:]  # fmt: skip

    # The same command once more: a run that has ended, nothing left to train, and last.ckpt left as it was.
    ended = last.read_bytes()
    third = run_train("fit", *quick_run_args(experiment, run_dir), *longer)
    assert third.returncode == 0, third.stderr[-3000:]
    assert resume_lines(third) == [f"resume: {last} ended its run already, at epoch 2 of trainer.max_epochs 2:"
                                   " nothing is left to train. Raise trainer.max_epochs to train on, or start a new"
                                   " run in another directory (--trainer.default_root_dir)"], third.stderr  # fmt: skip
    assert last.read_bytes() == ended

    # Fewer epochs than it trained: one line, nothing run (Lightning: a traceback once everything is set up).
    shorter = run_train("fit", *quick_run_args(experiment, run_dir), "--trainer.max_epochs", "1")
    assert shorter.returncode == 2, shorter.stderr[-3000:]
    assert shorter.stderr.strip().splitlines()[-1] == (
        f"error: checkpoint {last} had finished 2 epochs, past trainer.max_epochs 1: raise trainer.max_epochs to train"
        " on from it, or start afresh in a new run directory (--trainer.default_root_dir)"
    )
    # A try of the code in the run's directory (max_epochs 1 too): from the start, leaving the run's files alone.
    tried = run_train("fit", *quick_run_args(experiment, run_dir), "--trainer.fast_dev_run", "true")
    assert tried.returncode == 0, tried.stderr[-3000:]
    assert "trainer.fast_dev_run: starting afresh instead of resuming (ckpt_path: last)" in tried.stderr
    assert "Restoring states" not in tried.stderr and last.read_bytes() == ended


def test_a_sigterm_at_the_runs_last_step_keeps_its_end_for_a_longer_run_to_go_on_from_exactly(experiment, tmp_path):
    # The run's 4th and last step, before its validation and its last.ckpt: the same command again trains nothing.
    checkpoints, args = tmp_path / "run" / "checkpoints", ["fit", *quick_run_args(experiment, tmp_path / "run")]
    stopped = run_train(*args, *signal_at(4))
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    preempted = checkpoints / "preempted.ckpt"
    saved = preempted.read_bytes()
    again = run_train(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert resume_lines(again)[0] == (
        f"resume: {preempted} was saved at the run's last step (epoch 1 of trainer.max_epochs 1), before its last"
        " epoch's end: nothing is left to train. It stays, the run's newest checkpoint (`--ckpt_path last` finds it);"
        " its last validation did not run (`validate --ckpt_path last` runs it)"
    )
    assert preempted.read_bytes() == saved  # Lightning alone deleted it, and the run's only epoch with it

    # Trained on for another epoch from it: the weights of a run never stopped.
    longer = run_train(*args, "--trainer.max_epochs", "2")
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert resume_lines(longer)[0] == (
        f"resume: going on from {preempted}, saved at step 4 with 1 epoch finished; epoch 1's validation did not run"
    )
    whole = run_train("fit", *quick_run_args(experiment, tmp_path / "whole"), "--trainer.max_epochs", "2")
    assert whole.returncode == 0, whole.stderr[-3000:]
    resumed, uninterrupted = (torch.load(path / "last.ckpt", weights_only=True)
                              for path in (checkpoints, tmp_path / "whole" / "checkpoints"))  # fmt: skip
    assert resumed["global_step"] == uninterrupted["global_step"] == 8
    assert all(torch.equal(tensor, resumed["state_dict"][name]) for name, tensor in uninterrupted["state_dict"].items())
    assert not preempted.exists()


def resume_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("resume: ")]


def test_a_fit_started_from_another_runs_checkpoint_goes_on_from_its_own_when_run_again(experiment, tmp_path):
    # Fine-tuning from another run's (or a pretrained) checkpoint: a preempted job runs the same command again.
    first, second = tmp_path / "first", tmp_path / "second"
    assert run_train("fit", *quick_run_args(experiment, first)).returncode == 0  # 4 steps
    start = first / "checkpoints" / "last.ckpt"
    command = ["fit", *quick_run_args(experiment, second), "--trainer.max_epochs", "3", "--ckpt_path", str(start)]
    stopped = run_train(*command, *signal_at(6))
    assert stopped.returncode == 143, stopped.stderr[-3000:]

    again = run_train(*command)
    assert again.returncode == 0, again.stderr[-3000:]
    own = second / "checkpoints" / "preempted.ckpt"
    assert resume_lines(again)[0] == (
        f"resume: going on from this run's own {own}; ckpt_path {start} is where the run started (a new run directory"
        " starts from it again)"
    )  # Lightning alone started from the other run's checkpoint again, losing the steps since
    assert f"Restoring states from the checkpoint path at {own}" in again.stderr


def test_a_run_that_early_stopping_ended_trains_nothing_more_when_run_again(experiment, tmp_path):
    # val/acc can never improve by 0.5 twice: the run stops after its second epoch, long before max_epochs.
    run_dir, last = tmp_path / "run", tmp_path / "run" / "checkpoints" / "last.ckpt"
    stop_early = ["--trainer.max_epochs", "10", "--trainer.callbacks+=EarlyStopping", "--trainer.callbacks.monitor",
                  "val/acc", "--trainer.callbacks.mode", "max", "--trainer.callbacks.patience", "1",
                  "--trainer.callbacks.min_delta", "0.5"]  # fmt: skip
    first = run_train("fit", *quick_run_args(experiment, run_dir), *stop_early)
    assert first.returncode == 0, first.stderr[-3000:]
    stopped = torch.load(last, weights_only=True)["global_step"]
    assert stopped < 10 * 4  # 4 steps an epoch

    again = run_train("fit", *quick_run_args(experiment, run_dir), *stop_early)
    assert again.returncode == 0, again.stderr[-3000:]
    assert resume_lines(again) == [f"resume: {last} ended its run already: EarlyStopping on val/acc stopped it;"
                                   " nothing is left to train. Leave EarlyStopping out to train on, or start a new run"
                                   " in another directory (--trainer.default_root_dir)"], again.stderr  # fmt: skip
    assert torch.load(last, weights_only=True)["global_step"] == stopped  # Lightning alone trained another epoch


def test_a_runs_saved_config_starts_a_new_run_in_another_directory(experiment, tmp_path):
    # `--config runs/x/config.yaml` with another run directory: the same settings, a run of its own.
    first, second = tmp_path / "first", tmp_path / "second"
    assert run_train("fit", *quick_run_args(experiment, first)).returncode == 0
    for stage in ("test", "predict"):  # they read the run: its config.yaml stays the one fit trained with
        assert run_train(stage, *quick_run_args(experiment, first), "--ckpt_path", "last").returncode == 0

    def written(run: Path) -> dict[Path, int]:  # what a run writes itself (wandb's service may still write after it)
        return {path: path.stat().st_mtime_ns for path in [run / "config.yaml", *(run / "checkpoints").iterdir()]}

    before = written(first)
    again = run_train("fit", "--config", str(first / "config.yaml"), "--trainer.default_root_dir", str(second))
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"no checkpoint in {second / 'checkpoints'}: training from the start" in again.stderr, again.stderr[-3000:]
    assert (second / "checkpoints" / "last.ckpt").is_file() and (second / "wandb").is_dir()
    run_ids = [(run / "checkpoints" / "wandb-run-id").read_text() for run in (first, second)]
    assert run_ids[0] != run_ids[1], "the new run logs to the first run's wandb run"
    assert written(first) == before, "the new run wrote into the first one's directory"
    texts = [(run / "config.yaml").read_text() for run in (first, second)]
    assert str(first) not in texts[1], "a path of the first run in the second's config"
    saved = [yaml.safe_load(text.replace(str(first), str(second))) for text in texts]
    callbacks = [[callback["class_path"] for callback in config["trainer"].pop("callbacks")] for config in saved]
    assert saved[0] == saved[1] and callbacks[0] == callbacks[1], "other settings than the first run's"


def test_train_py_turns_the_garbage_collector_back_on_with_the_imports_frozen():
    # train.py pauses the collector while torch and Lightning import: training must not run without it.
    probe = "import gc, runpy; runpy.run_path('train.py'); print(gc.isenabled(), gc.get_freeze_count())"
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=PROJECT_ROOT, env=clean_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    enabled, frozen = result.stdout.split()
    assert enabled == "True"
    assert int(frozen) > 100_000  # torch's and Lightning's objects, never scanned again


@pytest.mark.parametrize("rank", [None, "1"], ids=["rank-0", "rank-1"])
def test_wandbs_launch_module_is_imported_before_torch_only_by_the_process_that_may_start_the_run(rank):
    # wandb.init imports it; with torch loaded that takes 1 s, before it 0.25 s (tracking/wandb_preload.py).
    probe = "import runpy; runpy.run_path('train.py')"
    env = clean_env(**({"RANK": rank, "WORLD_SIZE": "2"} if rank else {}))
    result = subprocess.run([sys.executable, "-X", "importtime", "-c", probe], cwd=PROJECT_ROOT, env=env,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    imported = [line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")]
    assert "torch" in imported
    if rank is None and sys.version_info < (3, 13):
        assert imported.index("wandb.sdk.launch.inputs.internal") < imported.index("torch")
    else:
        assert "wandb.sdk.launch.inputs.internal" not in imported


def test_test_subcommand_reports_accuracy_from_a_checkpoint(experiment, tmp_path):
    run_dir = tmp_path / "run"
    assert run_train("fit", *quick_run_args(experiment, run_dir)).returncode == 0
    tested = run_train(
        "test", *quick_run_args(experiment, run_dir), "--ckpt_path", str(run_dir / "checkpoints" / "last.ckpt")
    )
    assert tested.returncode == 0, tested.stderr[-3000:]
    assert "test/acc" in tested.stdout
    validated = run_train("validate", *quick_run_args(experiment, run_dir)[:-2], "--ckpt_path", "last")  # log lines
    assert validated.returncode == 0, validated.stderr[-3000:]
    assert re.search(r"^validate val/acc=\S+ val/loss=", validated.stderr, re.MULTILINE), validated.stderr[-3000:]
    assert "epoch 1/1 val" not in validated.stderr  # a checkpoint's weights, not its epoch, are what is validated


def test_print_config_is_complete_and_reusable(experiment, tmp_path):
    printed = run_train("fit", *quick_run_args(experiment, tmp_path / "run"), "--model.hidden", "64", "--print_config")
    assert printed.returncode == 0, printed.stderr[-3000:]
    config = yaml.safe_load(printed.stdout)
    assert config["model"]["class_path"] == "trainkit.testing.tiny.TinyClassifier"
    assert config["model"]["init_args"]["hidden"] == 64
    assert config["model"]["init_args"]["lr"] == 0.01  # from the model's own config file, which the experiment names
    assert config["cluster"]["timeout"] == "0:05:00"
    assert config["cluster"]["join_timeout"] == "0:10:00"
    assert {"trainer", "data", "seed_everything", "ckpt_path"} <= config.keys()

    saved = tmp_path / "printed.yaml"
    saved.write_text(printed.stdout)
    reused = run_train("fit", "--config", str(saved), "--print_config")
    assert reused.returncode == 0, reused.stderr[-3000:]
    assert yaml.safe_load(reused.stdout) == config


def test_unknown_option_is_refused_with_its_name(experiment, tmp_path):
    result = run_train("fit", *quick_run_args(experiment, tmp_path / "run"), "--model.hiden", "64")
    assert result.returncode != 0
    assert "hiden" in result.stderr
    assert not (tmp_path / "run").exists()


def test_wrong_cluster_variable_stops_before_training(experiment, tmp_path):
    env = clean_env(SING_RANK="3", SING_WORLD_SIZE="2", SING_MASTER_ADDR="127.0.0.1")
    result = run_train("fit", *quick_run_args(experiment, tmp_path / "run"), env=env, timeout=180)
    assert result.returncode == 2
    assert "error: SING_RANK=3 is outside 0..1 (SING_WORLD_SIZE=2)" in result.stderr
    assert "Traceback" not in result.stderr


def test_default_config_is_what_the_readme_says():
    config = yaml.safe_load(DEFAULTS.read_text())  # the kit's, loaded before configs/experiment.yaml
    assert config["ckpt_path"] == "last"
    assert config["trainer"]["logger"]["class_path"].endswith("WandbLogger")


def test_configs_compose_in_the_tests_own_process_as_train_py_composes_them(experiment, tmp_path):
    assert "class_path: trainkit.testing.tiny.TinyClassifier" in print_config("fit", "--config", str(experiment))
    misspelt = tmp_path / "misspelt.yaml"
    misspelt.write_text("model:\n  class_path: trainkit.testing.tiny.TinyClasifier\n")
    with pytest.raises(AssertionError, match="has no attribute 'TinyClasifier'"):
        print_config("fit", "--config", str(experiment), "--config", str(misspelt))


def test_a_model_or_data_module_of_another_class_starts_from_its_own_defaults(experiment, tmp_path):
    """jsonargparse would give the new class the options it shares with the one it replaces, and say nothing."""

    def model_and_data(*args: str) -> tuple[dict, dict]:
        printed = yaml.safe_load(print_config("fit", "--config", str(experiment), *args))
        return printed["model"], printed["data"]

    sharded = "trainkit.testing.tiny.TinyShardedClassifier"  # takes every option TinyClassifier takes
    model, data = model_and_data("--model.hidden", "48", "--model", sharded, "--data.num_workers", "3",
                                 "--data", "trainkit.data.streaming.StreamingImageDataModule")  # fmt: skip
    assert (model["class_path"], model["init_args"]["hidden"], data["init_args"]["num_workers"]) == (sharded, 32, 2)
    model, _ = model_and_data("--model.hidden", "48", "--model", "trainkit.testing.tiny.TinyClassifier")
    assert model["init_args"]["hidden"] == 48  # the same class again: options add to what is set
    model, _ = model_and_data("--model.hidden", "48", "--model", '{"init_args": {"dropout": 0.1}}')
    assert (model["init_args"]["hidden"], model["init_args"]["dropout"]) == (48, 0.1)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "sharded.yaml").write_text(f"class_path: {sharded}\ninit_args:\n  lr: 0.5\n")
    (tmp_path / "experiment.yaml").write_text("model: model/sharded.yaml\n")  # a config naming a config of its own
    model, _ = model_and_data("--model.hidden", "48", "--config", str(tmp_path / "experiment.yaml"))
    assert (model["class_path"], model["init_args"]["hidden"], model["init_args"]["lr"]) == (sharded, 32, 0.5)


class ClassesCountedInSetup(LightningDataModule):
    """Counts its classes in `setup`, as a data module that reads its labels there: too late to be passed on."""

    in_channels = TinyDataModule.in_channels

    def setup(self, stage: str) -> None:
        self.num_classes = TinyDataModule.num_classes
        self.tiny = TinyDataModule()
        self.tiny.setup(stage)

    def train_dataloader(self) -> DataLoader:
        return self.tiny.train_dataloader()

    def val_dataloader(self) -> DataLoader:
        return self.tiny.val_dataloader()

    def on_after_batch_transfer(self, batch: tuple[Tensor, Tensor], dataloader_idx: int) -> tuple[Tensor, Tensor]:
        return self.tiny.on_after_batch_transfer(batch, dataloader_idx)


def test_a_model_argument_the_data_module_does_not_give_is_said_and_one_it_replaces_is_refused(experiment, tmp_path):
    args = ["fit", "--config", str(experiment), "--trainer.fast_dev_run", "true", "--trainer.accelerator", "cpu",
            "--trainer.logger", "false", "--trainer.enable_progress_bar", "false"]  # fmt: skip

    def said(run: str, *more: str) -> list[str]:  # each in a run directory of its own: this process keeps its lock
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ProjectCLI(LightningModule, None, subclass_mode_model=True, subclass_mode_data=True,
                       args=[*args, "--trainer.default_root_dir", str(tmp_path / run), *more])  # fmt: skip
        return [str(warning.message) for warning in caught if "once built" in str(warning.message)]

    setup_only = ("--data", f"{__name__}.ClassesCountedInSetup")
    assert said("setup only", *setup_only) == [
        "model.num_classes is its default, 4: ClassesCountedInSetup has no num_classes once built. Set"
        " self.num_classes in its __init__ to pass it on (one set in setup comes too late), or set model.num_classes"
        " in the model's config."
    ]
    assert said("tiny data") == []  # the tests' own data module gives both
    assert said("set by hand", *setup_only, "--model.num_classes", "5") == []
    assert said("set as the data has it", "--model.num_classes", str(TinyDataModule.num_classes)) == []
    with pytest.raises(ConfigError, match=r"^model\.num_classes is 5, but TinyDataModule gives num_classes 4, which"):
        said("set otherwise", "--model.num_classes", "5")  # the data module's would replace it without a word


def test_callbacks_set_without_the_kits_checkpoints_are_said_once_before_training(experiment, tmp_path):
    # A config that sets trainer.callbacks replaces the kit's list: a researcher listing only their own loses what
    # preemption and resume rest on, and a SIGTERM would then exit 143 having saved nothing.
    own_only = tmp_path / "own-callbacks.yaml"
    own_only.write_text("trainer:\n  callbacks:\n    - class_path: trainkit.checkpoints.last.LastCheckpoint\n")
    args = ["fit", "--config", str(experiment), "--config", str(own_only), "--trainer.max_steps", "1",
            "--trainer.limit_val_batches", "0", "--trainer.accelerator", "cpu", "--trainer.logger", "false",
            "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path / "run")]  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ProjectCLI(LightningModule, None, subclass_mode_model=True, subclass_mode_data=True, args=args)
    said = [str(warning.message) for warning in caught if "trainer.callbacks has no" in str(warning.message)]
    assert said == [
        "trainer.callbacks has no PreemptionCheckpoint, PeriodicCheckpoint, RNGStateCheckpoint: a SIGTERM saves"
        " nothing; a hard kill loses all since the epoch began; a resumed run draws other random numbers. A config"
        " that sets trainer.callbacks replaces the kit's list (src/trainkit/defaults.yaml): add a callback with"
        " --trainer.callbacks+=<class path> instead, or copy that list and edit it."
    ]


def test_a_model_that_does_not_log_the_monitored_metric_trains_to_the_end_saving_last_every_epoch(experiment, tmp_path):
    # Lightning's own demo model and data logs no metric at all: the experiment's monitor costs no epoch.
    run_dir = tmp_path / "run"
    demo = ["--model", "lightning.pytorch.demos.boring_classes.BoringModel",
            "--data", "lightning.pytorch.demos.boring_classes.BoringDataModule"]  # fmt: skip
    result = run_train("fit", "--config", str(experiment), *quick_trainer_args(run_dir), *demo,
                       "--trainer.max_epochs", "2")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    said = [line for line in result.stderr.splitlines() if "best_checkpoint.monitor" in line]
    assert len(said) == 1 and "validation logs no metric, not 'val/acc'" in said[0], result.stderr[-3000:]
    checkpoints = run_dir / "checkpoints"
    assert torch.load(checkpoints / "last.ckpt", weights_only=False)["epoch"] == 1  # saved at the end of both epochs
    assert not list(checkpoints.glob("best*"))


RESEARCHERS_DATA = """
from lightning.pytorch import LightningDataModule
from trainkit.run.errors import ConfigError


class RefusesInInit(LightningDataModule):
    def __init__(self, root: str = "corpus") -> None:
        super().__init__()
        raise ConfigError(f"data.root {root!r} holds no text files")


class OutOfRangeInInit(LightningDataModule):
    def __init__(self, noise: float = -1.0) -> None:
        super().__init__()
        if noise < 0:
            raise ValueError(f"noise {noise} is below 0")


class OpensInInit(LightningDataModule):
    def __init__(self, root: str = "corpus.txt") -> None:
        super().__init__()
        open(root)


class OpensInSetup(LightningDataModule):
    def setup(self, stage: str) -> None:
        open("corpus/train.txt")
"""


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("researchers_data.RefusesInInit", "error: data.root 'corpus' holds no text files"),
        (
            "researchers_data.OutOfRangeInInit",
            "error: noise -1.0 is below 0 (in OutOfRangeInInit.__init__, {tmp_path}/researchers_data.py:16)",
        ),
        ("researchers_data.OpensInInit", "error: [Errno 2] No such file or directory: 'corpus.txt'"),
        ("researchers_data.OpensInSetup", "error: [Errno 2] No such file or directory: 'corpus/train.txt'"),
        ("configs/data/text_copus.yaml", "error: data: configs/data/text_copus.yaml: no such config file"),
    ],
    ids=[
        "ConfigError in __init__",
        "ValueError in __init__",
        "missing file in __init__",
        "missing file in setup",
        "misspelt config path",
    ],
)
def test_the_researchers_data_module_refusing_its_input_is_one_line(experiment, tmp_path, data, message):
    (tmp_path / "researchers_data.py").write_text(RESEARCHERS_DATA)
    env = clean_env(PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ["PYTHONPATH"]]))
    result = run_train(
        "fit", "--config", str(experiment), *quick_trainer_args(tmp_path / "run"), "--data", data, env=env
    )
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "Error" in line or line.startswith("error:")]
    assert errors == [message.format(tmp_path=tmp_path)], result.stderr[-3000:]


def test_a_model_and_data_module_with_a_hyperparameter_of_one_name_and_two_values_train(experiment, tmp_path):
    """Lightning refused to start the fit: "Error while merging hparams", a traceback and exit 1."""
    pair = ("--model", "tasks.named_alike.WideRegressor", "--data", "tasks.named_alike.ColourTable")
    result = run_train("fit", "--config", str(experiment), *quick_trainer_args(tmp_path / "run"), *pair,
                       "--best_checkpoint.monitor", "val_loss")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())  # what the logger gets, both whole
    assert config["model"]["init_args"]["channels"] == 32 and config["data"]["init_args"]["channels"] == 3


def test_a_setting_lightning_refuses_at_the_first_epochs_end_is_one_line_after_last_ckpt(experiment, tmp_path):
    """A ReduceLROnPlateau on a metric validation does not log: exit 2 (a retry fails the same), the epoch kept."""
    model = ("--model", "tasks.broken.ReducesOnAMetricItNeverLogs", "--data", "tasks.regression.Table")
    result = run_train("fit", "--config", str(experiment), *quick_trainer_args(tmp_path / "run"), *model,
                       "--best_checkpoint.monitor", "val_loss")  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "Error" in line or line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: ReduceLROnPlateau conditioned on metric val/rmse"), errors
    assert "val_loss" in errors[0], "the line names the metrics validation logs"
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file(), "the epoch it trained is kept"


def test_a_validation_interval_longer_than_the_epoch_is_one_line(experiment, tmp_path):
    # Lightning checks it against the training loader's length as the fit starts, with a ValueError.
    result = run_train("fit", *quick_run_args(experiment, tmp_path / "run"), "--trainer.val_check_interval", "40")
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith(
        "error: trainer: `val_check_interval` (40) must be less than or equal to the number of the training batches"
        " (4)."
    ), line
    assert "Traceback" not in result.stderr and not (tmp_path / "run" / "config.yaml").exists()


def test_a_validation_interval_longer_than_an_epoch_of_a_stream_is_one_line_once_that_epoch_ended(experiment, tmp_path):
    # A stream with no length: Lightning cannot check it as the fit starts, and validation would never run.
    stream = ["--model", "tasks.sines.PhaseReader", "--data", "tasks.sines.SinesOfAFiniteStream",
              "--best_checkpoint.monitor", "val_mse/dataloader_idx_0", "--trainer.limit_train_batches", "1.0",
              "--trainer.max_epochs", "3", "--trainer.val_check_interval", "40"]  # fmt: skip
    result = run_train("fit", *quick_run_args(experiment, tmp_path / "run"), *stream)
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert line == (
        "error: trainer.val_check_interval 40 is more batches than an epoch of the training loader gives (10; it has"
        " no length, so this shows only once an epoch ended): with trainer.check_val_every_n_epoch 1 validation never"
        " runs. Set val_check_interval to at most 10, or check_val_every_n_epoch null to count batches across epochs"
    ), line
    assert "Traceback" not in result.stderr
    # Counted across epochs, the same interval validates every 40 batches: it trains.
    across = run_train("fit", *quick_run_args(experiment, tmp_path / "across"), *stream,
                       "--trainer.check_val_every_n_epoch", "null", "--trainer.max_epochs", "5")  # fmt: skip
    assert across.returncode == 0, across.stderr[-3000:]
    assert len(list((tmp_path / "across" / "checkpoints").glob("best-*.ckpt"))) == 1, "it validated"


def test_a_call_of_lightnings_it_refuses_in_the_models_code_is_one_line_naming_where(experiment, tmp_path):
    model = ("--model", "tasks.broken.LogsANameLightningRefuses", "--data", "tasks.regression.Table")
    result = run_train("fit", "--config", str(experiment), *quick_trainer_args(tmp_path / "run"), *model,
                       "--best_checkpoint.monitor", "null")  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    logged = next(number for number, text in enumerate((PROJECT_ROOT / "tasks" / "broken.py").open(), 1)
                  if '"val_loss/dataloader_idx_0"' in text)  # fmt: skip
    assert line.startswith("error: You called `self.log` with the key `val_loss/dataloader_idx_0`"), line
    assert line.endswith(f" (in LogsANameLightningRefuses.validation_step, tasks/broken.py:{logged})"), line


def test_a_fresh_run_and_its_rerun_print_nothing_a_researcher_cannot_act_on(experiment, tmp_path):
    periodic = tmp_path / "periodic.yaml"  # a save every 2 steps: a line a save would print shows 2 times and more
    periodic.write_text(DEFAULTS.read_text().replace("every_minutes: 10", "every_n_steps: 2"))
    args = [*quick_run_args(experiment, tmp_path / "run"), "--config", str(periodic)]
    outputs = {}
    for run in ("fresh", "rerun"):
        result = run_train("fit", *args, "--trainer.max_epochs", "1" if run == "fresh" else "2")
        assert result.returncode == 0, result.stderr[-3000:]
        outputs[run] = output = result.stdout + result.stderr
        for noise in ("weights_only", "exists and is not empty", "Tip:", "anonymous setting", "LeafSpec"):
            assert noise not in output, f"{run}: {noise!r} in\n{output[-3000:]}"
    said = [line for line in outputs["fresh"].splitlines() if line.startswith("no checkpoint in")]
    assert said == [f"no checkpoint in {tmp_path / 'run' / 'checkpoints'}: training from the start"], said


def test_lightnings_names_for_ddp_and_fsdp_keep_the_clusters_timeouts():
    """ "ddp" (what "auto" picks for several processes) and the names that differ from it only in
    find_unused_parameters, with the settings of the latest run in this process."""
    use_timeouts_for_ddp(ClusterSettings(timeout=timedelta(seconds=20), join_timeout=timedelta(seconds=40)))
    use_timeouts_for_ddp(ClusterSettings(timeout=timedelta(seconds=30), join_timeout=timedelta(seconds=50)))
    for name, find_unused in [("ddp", False), ("ddp_find_unused_parameters_false", False),
                              ("ddp_find_unused_parameters_true", True)]:  # fmt: skip
        strategy = StrategyRegistry.get(name)
        assert isinstance(strategy, WatchedDDPStrategy), name
        assert (strategy._timeout, strategy.join_timeout) == (timedelta(seconds=30), timedelta(seconds=50)), name
        assert strategy._ddp_kwargs.get("find_unused_parameters", False) is find_unused, name
        assert strategy._start_method == "popen", name
    for name in ("ddp_spawn", "ddp_fork", "ddp_notebook", "fsdp", "fsdp_cpu_offload"):  # the timeout only
        assert StrategyRegistry.get(name)._timeout == timedelta(seconds=30), name


def test_lightnings_ddp_configured_by_its_class_keeps_the_clusters_timeouts(experiment, tmp_path):
    """With arguments of its own (as configs set find_unused_parameters, static_graph, ...) Lightning's DDPStrategy
    would wait 30 minutes for a lost node: it becomes the kit's, whose stalled-node drills run "ddp" by name."""
    cli = ProjectCLI(LightningModule, None, subclass_mode_model=True, subclass_mode_data=True, args=[
        "fit", "--config", str(experiment), "--trainer.fast_dev_run", "true", "--trainer.accelerator", "cpu",
        "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(tmp_path), "--trainer.strategy", "DDPStrategy",
        "--trainer.strategy.gradient_as_bucket_view", "true", "--cluster.timeout", "0:00:20",
        "--cluster.join_timeout", "0:00:40"])  # fmt: skip
    if torch.distributed.is_initialized():  # the fit's group of one process: Lightning leaves it to the process's end
        torch.distributed.destroy_process_group()
    strategy = cli.trainer.strategy
    assert isinstance(strategy, WatchedDDPStrategy), type(strategy)
    assert (strategy._timeout, strategy.join_timeout) == (timedelta(seconds=20), timedelta(seconds=40))
    assert strategy._ddp_kwargs["gradient_as_bucket_view"] is True


def test_a_callback_added_or_left_out_on_resume_is_named_once():
    def config(*callbacks: dict) -> dict:
        return {"trainer": {"max_epochs": 2, "callbacks": list(callbacks)}, "model": {"init_args": {"lr": 0.01}}}

    periodic = {"class_path": "trainkit.checkpoints.periodic.PeriodicCheckpoint", "init_args": {"every_n_steps": 3}}
    finder = {"class_path": "lightning.pytorch.callbacks.LearningRateFinder", "init_args": {"num_training_steps": 5}}
    model_checkpoint = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"every_n_epochs": 1}}
    every_2 = {**model_checkpoint, "init_args": {"every_n_epochs": 2}}
    before = config(model_checkpoint, periodic, finder)
    now = config(model_checkpoint, every_2, {**periodic, "init_args": {"every_n_steps": 5}})
    assert config_changes(before, now) == [
        "trainer.callbacks.LearningRateFinder left out",
        "trainer.callbacks.ModelCheckpoint[2] added",
        "trainer.callbacks.PeriodicCheckpoint.init_args.every_n_steps 5 (was 3)",
    ]
    assert config_changes(now, before)[0] == "trainer.callbacks.LearningRateFinder added"
    assert config_changes(before, before) == []


def test_early_stopping_ends_a_run_only_past_its_minimum_epochs_and_steps():
    stopper = EarlyStopping("val/acc", patience=1)
    checkpoint = {"global_step": 8, "loops": {"fit_loop": {"epoch_progress": {"current": {"processed": 2}}}},
                  "callbacks": {stopper.state_key: {**stopper.state_dict(), "wait_count": 1}}}  # fmt: skip

    def stopped(**minimum: int) -> bool:
        trainer = Trainer(callbacks=[stopper], logger=False, enable_checkpointing=False, **minimum)
        return stopped_early(trainer, checkpoint) is stopper

    assert stopped() and stopped(min_epochs=2) and stopped(min_steps=8)
    assert not stopped(min_epochs=3) and not stopped(min_steps=9)


def test_lightnings_fsdp_configured_by_its_class_keeps_the_clusters_timeout():
    # On GPUs only, so not run here: its config as the command line parses it, before the Trainer is built.
    fsdp = "lightning.pytorch.strategies.FSDPStrategy"
    strategy = Namespace(class_path=fsdp, init_args=Namespace(timeout=timedelta(minutes=30), cpu_offload=True))
    watch_ddp_configured_by_class(strategy, Namespace(timeout=timedelta(seconds=30), join_timeout=timedelta(minutes=1)))
    assert strategy == Namespace(class_path=fsdp, init_args=Namespace(timeout=timedelta(seconds=30), cpu_offload=True))
