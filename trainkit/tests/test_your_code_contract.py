"""The contract a project puts its own model and data through (trainkit.testing.contract), tried on pairs unlike the
tests' tiny image classifier: a character language model on text files, a regression with batch norm on a table
that logs only `val_loss`, a GAN that optimizes by hand and draws noise in validation, and Lightning's own demo
model with loaders of its own (`--data null`). Then pairs broken on purpose, each failing in one line that names
the problem."""

import subprocess
import sys
from pathlib import Path

import pytest

from trainkit.run.replaced_classes import replace_whole
from trainkit.run.researchers_code import raised_in
from trainkit.testing.contract import YourCodeContract

from .conftest import KIT_ROOT
from .helpers import PROJECT_ROOT, clean_env

sys.path.insert(0, str(PROJECT_ROOT))  # the pairs' modules (project/tasks/), as train.py finds them
EXPERIMENT = ("--config", "configs/experiment.yaml")  # the tests' experiment: it monitors val/acc


class DrilledOnTwoProcesses(YourCodeContract):
    """The contract with its drill on 2 processes only, which runs every step of the 1-process one and DDP besides: the
    kit's own drills resume the tiny pair each way on 1 process, and a project's `pytest -m drills` runs both."""

    @pytest.mark.drills
    def test_sigterm_at_an_epochs_end_then_mid_epoch_then_the_same_command_trains_the_same_weights(self, tmp_path):
        self.drill(tmp_path, "--trainer.devices", "2")


class TestACharacterLanguageModelOnTextFiles(DrilledOnTwoProcesses):
    project = PROJECT_ROOT
    # Validated by steps, across epochs, as language models often are: every 40 steps, more than a quick epoch has.
    args = (*EXPERIMENT, "--model", "tasks.char_lm.CharLanguageModel", "--data", "tasks.char_lm.TextFiles",
            "--data.root", str(KIT_ROOT / "docs"), "--best_checkpoint.monitor", "val/loss",
            "--trainer.check_val_every_n_epoch", "null", "--trainer.val_check_interval", "40")  # fmt: skip

    def test_the_quick_runs_validate_by_steps_as_the_project_does(self):
        assert self.quick_val_check_interval() == self.steps_per_epoch  # Lightning refuses 1.0 when validating by steps


class TestARegressionOnATable(DrilledOnTwoProcesses):
    project = PROJECT_ROOT
    # Batch norm synchronised over the processes, as on GPUs (torch's SyncBatchNorm runs on GPUs only); validation
    # twice an epoch, which the quick runs keep: the drill stops and resumes between the two.
    args = (*EXPERIMENT, "--model", "tasks.regression.Regressor", "--data", "tasks.regression.Table",
            "--best_checkpoint.monitor", "val_loss", "--trainer.sync_batchnorm", "true",
            "--trainer.val_check_interval", "0.5")  # fmt: skip

    def test_the_quick_runs_validate_as_often_as_the_project_does(self):
        assert self.quick_val_check_interval() == 0.5


class TestAGANWithTwoOptimizersAndNoiseInValidation(DrilledOnTwoProcesses):
    project = PROJECT_ROOT
    # Each optimizer's step leaves the other network out of its loss: DDP must look for unused parameters.
    args = (*EXPERIMENT, "--model", "tasks.gan.GAN", "--data", "tasks.gan.Ring",
            "--best_checkpoint.monitor", "val/discriminator_loss",
            "--trainer.strategy", "ddp_find_unused_parameters_true")  # fmt: skip


class TestLightningsDemoModelWithLoadersOfItsOwn(DrilledOnTwoProcesses):
    project = PROJECT_ROOT
    args = (*EXPERIMENT, "--model", "lightning.pytorch.demos.boring_classes.BoringModel", "--data", "null",
            "--best_checkpoint.monitor", "null")  # fmt: skip


BROKEN_PAIR = """
import sys
from pathlib import Path
from trainkit.testing.contract import YourCodeContract

sys.path.insert(0, {project!r})

class TestBrokenPair(YourCodeContract):
    project = Path({project!r})
    args = {args!r}
"""

VAL_LOADER_LINE = next(number for number, line in enumerate((PROJECT_ROOT / "tasks" / "regression.py").open(), 1)
                       if "return DataLoader(self.val" in line)  # fmt: skip
MATMUL_LINE = next(number for number, line in enumerate((PROJECT_ROOT / "tasks" / "broken.py").open(), 1)
                   if "features @ torch.ones" in line)  # fmt: skip


@pytest.mark.parametrize(
    ("model", "data", "monitor", "failing", "line"),
    [
        ("tasks.regression.Regressor", "tasks.broken.BatchesOfItsOwn", "val_loss",
         "test_the_training_loader_resumes_mid_epoch",
         "exact resume: the training loader uses a batch sampler of its own (ShuffledBatches) with no length, so a"
         ' resume mid-epoch starts the epoch over (docs/data.md, "Which training loaders resume mid-epoch")'),
        ("tasks.regression.Regressor", "tasks.regression.Table", "val/acc",
         "test_the_monitored_metric_is_one_the_model_logs",
         "best_checkpoint.monitor: validation logs val_loss, not 'val/acc': no best checkpoint is kept while it is"
         " missing (last.ckpt is). Set it to a metric the model logs, or null (configs/experiment.yaml)."),
        ("tasks.regression.Regressor", "tasks.broken.RefusesItsRoot", "val_loss",
         "test_a_few_steps_train_validate_and_save_last_ckpt_every_epoch",
         "training: train.py fit ended with exit 2: error: data.root 'corpus' holds no table"),
        ("tasks.broken.MultipliesTheWrongShapes", "tasks.regression.Table", "val_loss",
         "test_a_few_steps_train_validate_and_save_last_ckpt_every_epoch",
         "training: train.py fit ended with exit 1: RuntimeError: mat1 and mat2 shapes cannot be multiplied (16x4 and"
         f" 5x1) (in training_step, tasks/broken.py:{MATMUL_LINE})"),
        ("tasks.regression.Regressor", "tasks.broken.SetsUpOnlyForFit", "val_loss",
         "test_a_checkpoint_loads_back_to_the_same_validation",
         "validate: Trainer.validate on last.ckpt raised AttributeError: 'SetsUpOnlyForFit' object has no attribute"
         f" 'val' (in SetsUpOnlyForFit.val_dataloader, tasks/regression.py:{VAL_LOADER_LINE}): Lightning calls"
         " setup('validate') before validate, and setup('fit') only before fit"),
        ("tasks.broken.DivergesToNaN", "tasks.regression.Table", "val_loss",
         "test_a_checkpoint_loads_back_to_the_same_validation",
         "training: validating last.ckpt gives [{'val_loss': nan}]: after the quick fit the model's scores are not"
         " finite"),
    ],
    ids=["a batch sampler of its own", "a monitored metric the model never logs", "ConfigError in __init__",
         "an error in the model's code", "data set up for fit only", "a model that diverges"],
)  # fmt: skip
def test_a_broken_pair_fails_one_test_in_one_line_naming_the_problem(tmp_path: Path, model, data, monitor, failing,
                                                                      line):  # fmt: skip
    args = (*EXPERIMENT, "--model", model, "--data", data, "--best_checkpoint.monitor", monitor)
    report = contract_report(tmp_path, args, "not drills")
    failed = [row for row in report.splitlines() if row.startswith("FAILED")]
    assert failed == [f"FAILED test_pair.py::TestBrokenPair::{failing} - AssertionError: {line}"], report[-4000:]


@pytest.mark.drills
@pytest.mark.parametrize(
    ("model", "likely"),
    [
        ("tasks.broken.WarmsUpOnAPlainCounter",
         "training depends on state the checkpoint does not keep: a plain attribute that changes as it trains"),
        ("tasks.broken.AnnealsAtEachEpochsEnd",
         "AnnealsAtEachEpochsEnd.on_train_epoch_end runs at each epoch's end, and a run stopped at an epoch's last step"
         " resumes with the next epoch, without that epoch's end hooks: set what training depends on from"
         " self.current_epoch in on_train_epoch_start instead (docs/checkpoints.md); or training depends on state"),
    ],
    ids=["state in a plain attribute", "state changed at epochs' ends"],
)  # fmt: skip
def test_a_model_that_resumes_otherwise_fails_the_drill_naming_the_likely_cause(tmp_path: Path, model, likely):
    args = (*EXPERIMENT, "--model", model, "--data", "tasks.regression.Table", "--best_checkpoint.monitor", "val_loss")
    report = contract_report(tmp_path, args, "drills", "-k", "1-process")
    failed = [row for row in report.splitlines() if row.startswith("FAILED")]
    assert len(failed) == 1 and failed[0].startswith(
        "FAILED test_pair.py::TestBrokenPair::test_sigterm_at_an_epochs_end_then_mid_epoch_then_the_same_command_trains"
        "_the_same_weights[1-process] - AssertionError: exact resume: after SIGTERM at steps 8 and 9 and the same"
        f" command again, the weights differ from an uninterrupted run's; {likely}"
    ), report[-4000:]
    assert "def drill" not in report, report[-4000:]  # the failure's message, not the drill's code


def contract_report(tmp_path: Path, args: tuple[str, ...], marks: str, *options: str) -> str:
    """What `pytest -m MARKS` prints for the contract on the pair of `args`, as a project runs it."""
    (tmp_path / "test_pair.py").write_text(BROKEN_PAIR.format(project=str(PROJECT_ROOT), args=args))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-vv", "-p", "no:cacheprovider", "-o", "markers=drills", "-m", marks,
         "-rf", *options, "test_pair.py"],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    return result.stdout


@pytest.mark.drills
def test_the_sharded_drill_resumes_a_model_that_shards_to_the_same_weights(tmp_path: Path):
    class ShardingPair(YourCodeContract):  # the tests' tiny classifier, made ready for sharding
        project = PROJECT_ROOT
        args = (*EXPERIMENT, "--model", "trainkit.testing.tiny.TinyShardedClassifier")

    ShardingPair.run_args = ShardingPair.args
    ShardingPair().test_sharded_on_2_processes_sigterm_then_the_same_command_trains_the_same_weights(tmp_path)


@pytest.mark.drills
@pytest.mark.parametrize(
    "data",
    ["tasks.regression.WeightedTable", "tasks.regression.SplitByIndices", "tasks.regression.SharedOutByItself"],
    ids=["weighted", "subset", "distributed"],
)
def test_the_drill_resumes_a_sampler_of_the_data_modules_to_the_same_weights(tmp_path: Path, data: str):
    class SamplerPair(YourCodeContract):  # rows drawn by a WeightedRandomSampler or a SubsetRandomSampler
        project = PROJECT_ROOT
        args = (*EXPERIMENT, "--model", "tasks.regression.Regressor", "--data", data,
                "--best_checkpoint.monitor", "val_loss")  # fmt: skip

    SamplerPair.run_args = SamplerPair.args
    SamplerPair().drill(tmp_path, "--trainer.devices", "2")


@pytest.mark.drills
def test_the_drill_resumes_two_training_loaders_that_lightning_combines_to_the_same_weights(tmp_path: Path):
    class SemiSupervisedPair(YourCodeContract):  # a batch of labeled rows and one of all rows, the labeled cycled
        project = PROJECT_ROOT
        args = (*EXPERIMENT, "--model", "tasks.regression.SemiSupervisedRegressor",
                "--data", "tasks.regression.LabeledAndUnlabeled", "--best_checkpoint.monitor", "val_loss")  # fmt: skip

    SemiSupervisedPair.run_args = SemiSupervisedPair.args
    SemiSupervisedPair().drill(tmp_path, "--trainer.devices", "2")


@pytest.mark.drills
def test_the_drill_resumes_augmentation_drawn_in_loader_workers_to_the_same_weights(tmp_path: Path):
    class AugmentedPair(YourCodeContract):  # noise added to each row as two loader workers read it
        project = PROJECT_ROOT
        args = (*EXPERIMENT, "--model", "tasks.regression.Regressor", "--data", "tasks.regression.AugmentedTable",
                "--best_checkpoint.monitor", "val_loss")  # fmt: skip

    AugmentedPair.run_args = AugmentedPair.args
    AugmentedPair().drill(tmp_path, "--trainer.devices", "2")


@pytest.mark.drills
def test_the_drill_resumes_a_language_model_on_lines_batched_by_length_to_the_same_weights(tmp_path: Path):
    class LinesPair(YourCodeContract):  # a batch sampler of the data module's own, which Lightning shares out
        project = PROJECT_ROOT
        args = (*EXPERIMENT, "--model", "tasks.char_lm.CharLanguageModel", "--data", "tasks.char_lm.LinesByLength",
                "--data.root", str(KIT_ROOT / "docs"), "--best_checkpoint.monitor", "val/loss")  # fmt: skip

    LinesPair.run_args = LinesPair.args
    LinesPair().drill(tmp_path, "--trainer.devices", "2")


def test_an_error_raised_in_the_kit_a_project_carries_is_placed_in_the_researchers_code():
    """A project carries the kit in its own folder (src/trainkit); a frame there is not the researcher's. Here the kit's
    folder stands for such a project, and this file for the researcher's code."""

    def researchers_step() -> None:
        replace_whole(None)  # raises in the kit

    with pytest.raises(TypeError) as raised:
        researchers_step()
    function, where = raised_in(raised.value, KIT_ROOT)
    assert function.endswith("researchers_step") and where.startswith("tests/test_your_code_contract.py:"), where
