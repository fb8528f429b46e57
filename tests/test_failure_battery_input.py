"""The failure battery, bad input: bad settings, config files, data files and checkpoints end in one line.

Each case runs the default generated project's `train.py fit` for real on the real digits, on CPU,
with one bad thing in it. Promised: exit status 2 (a configuration error: retrying cannot help)
within seconds, one `error:` line that says what is wrong and where (the key, the config file, the
data file and what it holds, the checkpoint and what to do), no usage text, no traceback, and no
checkpoint written or changed, nor the config.yaml of the run that saved them. Settings and config
files are checked before anything starts, so their line is the first thing the run prints.
"""

import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from .battery import assert_refused, run_project

CONFIG_ERROR = 2
WITHIN_SECONDS = 60  # refused at start-up: imports and parsing, or the trainer's set-up (a few seconds each)
IMAGES, LABELS = "train-images-idx3-ubyte", "train-labels-idx1-ubyte"


def fit(digits: Path, run_dir: Path, *more: str) -> list[str]:
    """The default experiment for two steps on CPU, reading `digits`, writing to `run_dir`."""
    return [
        "fit", "--config", "configs/experiment.yaml",
        "--trainer.accelerator", "cpu",
        "--trainer.max_epochs", "1",
        "--trainer.limit_train_batches", "2",
        "--trainer.limit_val_batches", "1",
        "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(run_dir),
        "--data.data_dir", str(digits),
        "--data.download", "false",
        "--data.batch_size", "32",
        *more,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def trained_run(default_project: Path, real_mnist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished two-step run of the default model (hidden: 128): its run directory, with checkpoints/last.ckpt."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    ending = run_project(default_project, *fit(real_mnist, run_dir))
    assert ending.code == 0, ending.tail()
    return run_dir


@pytest.fixture(scope="module")
def three_epoch_run(default_project: Path, real_mnist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run of three epochs of two steps: its run directory."""
    run_dir = tmp_path_factory.mktemp("three-epochs") / "run"
    ending = run_project(default_project, *fit(real_mnist, run_dir, "--trainer.max_epochs", "3"))
    assert ending.code == 0, ending.tail()
    return run_dir


class Case:
    """What one bad input needs: a directory of its own, the real digits and, when asked, a trained run."""

    def __init__(self, tmp_path: Path, real_mnist: Path, request: pytest.FixtureRequest) -> None:
        self.tmp_path, self.digits, self.request = tmp_path, real_mnist, request
        self.run_dir = tmp_path / "run"

    def file(self, name: str, text: str) -> Path:
        path = self.tmp_path / name
        path.write_text(text)
        return path

    def damaged_digits(self, damage: Callable[[Path], None]) -> Path:
        """A copy of the real digits with `damage` done to its MNIST/raw directory."""
        copy = self.tmp_path / "digits"
        shutil.copytree(self.digits, copy)
        damage(copy / "MNIST" / "raw")
        return copy

    def trained_run(self, name: str = "trained_run") -> Path:
        return self.request.getfixturevalue(name)


def unknown_key(case: Case) -> tuple[list[str], list[str]]:
    # Given beside the file of its section, as one change is tried: the line names no file, which holds no such key.
    return ["--model", "configs/model/image_classifier.yaml", "--model.hiden", "64"], ["error: model: ", "'hiden'"]


def abbreviated_option(case: Case) -> tuple[list[str], list[str]]:
    # argparse's default takes the start of an option for the option: a typo can set another one.
    return ["--trainer.max_ep", "1"], ["unrecognized arguments", "--trainer.max_ep"]


def unknown_key_in_yaml(case: Case) -> tuple[list[str], list[str]]:
    config = case.file("typo.yaml", "model:\n  hiden: 64\n")
    return ["--config", str(config)], [str(config), "'hiden'"]


def wrong_type_in_yaml(case: Case) -> tuple[list[str], list[str]]:
    config = case.file("wrong-type.yaml", "trainer:\n  max_epochs: three\n")
    return ["--config", str(config)], [str(config), "trainer.max_epochs", "three"]


def unknown_key_in_a_model_file(case: Case) -> tuple[list[str], list[str]]:
    model = "class_path: lightning_mnist.models.image_classifier.ImageClassifier\ninit_args:\n  hiden: 64\n"
    config = case.file("typo-model.yaml", model)
    return ["--model", str(config)], [str(config), "model: ", "'hiden'"]


def wrong_type_in_a_file_a_config_names(case: Case) -> tuple[list[str], list[str]]:
    (case.tmp_path / "model").mkdir()
    model = case.file("model/wrong-type.yaml", "init_args:\n  dropout: high\n")
    config = case.file("experiment.yaml", "model: model/wrong-type.yaml\n")
    return ["--config", str(config)], [str(model), "model.dropout", "high"]


def missing_config_file(case: Case) -> tuple[list[str], list[str]]:
    config = case.tmp_path / "nowhere.yaml"
    return ["--config", str(config)], ["does not exist", str(config)]


def unknown_class_path(case: Case) -> tuple[list[str], list[str]]:
    return ["--model.optimizer", "torch.optim.Adamm"], ["model.optimizer", "Adamm"]


def unknown_class_path_in_yaml(case: Case) -> tuple[list[str], list[str]]:
    config = case.file("class.yaml", "data:\n  class_path: torch.nn.NoSuchDataModule\n")
    return ["--config", str(config)], [str(config), "data", "NoSuchDataModule"]


def yaml_syntax_error(case: Case) -> tuple[list[str], list[str]]:
    config = case.file("syntax.yaml", "trainer:\n  max_epochs: [1\n")
    return ["--config", str(config)], [str(config), "line 3", "while parsing a flow sequence at line 2"]


def empty_yaml(case: Case) -> tuple[list[str], list[str]]:
    config = case.file("empty.yaml", "")
    return ["--config", str(config)], [str(config), "holds no settings"]


def trainer_setting_lightning_refuses(case: Case) -> tuple[list[str], list[str]]:
    return ["--trainer.max_epochs", "-5"], ["trainer: `max_epochs` must be a non-negative integer or -1", "-5"]


def negative_learning_rate(case: Case) -> tuple[list[str], list[str]]:
    # torch's optimizer refuses it when the model makes it: a ValueError where the run starts, not a traceback.
    return ["--model.optimizer.init_args.lr", "-1"], ["Invalid learning rate: -1.0",
                                                      "(in ImageClassifier.configure_optimizers, src/"]  # fmt: skip


def batch_size_zero(case: Case) -> tuple[list[str], list[str]]:
    return ["--data.batch_size", "0"], ["data.batch_size", "greater than 0", "got 0"]


def dropout_above_one(case: Case) -> tuple[list[str], list[str]]:
    return ["--model.dropout", "1.5"], ["model.dropout", "less than or equal to 1", "got 1.5"]


def truncated_images(case: Case) -> tuple[list[str], list[str]]:
    def cut(raw: Path) -> None:
        (raw / IMAGES).write_bytes((raw / IMAGES).read_bytes()[:3_000_000])

    digits = case.damaged_digits(cut)
    return ["--data.data_dir", str(digits)], [str(digits / "MNIST" / "raw" / IMAGES), "holds 3,000,000 bytes",
                                              "8000x28x28", "truncated"]  # fmt: skip


def garbage_images(case: Case) -> tuple[list[str], list[str]]:
    def overwrite(raw: Path) -> None:
        (raw / IMAGES).write_bytes(random.Random(0).randbytes(100_000))

    digits = case.damaged_digits(overwrite)
    return ["--data.data_dir", str(digits)], [str(digits / "MNIST" / "raw" / IMAGES), "not an IDX file"]


def fewer_labels_than_images(case: Case) -> tuple[list[str], list[str]]:
    def keep_7000_labels(raw: Path) -> None:
        labels = (raw / LABELS).read_bytes()
        (raw / LABELS).write_bytes(labels[:4] + (7000).to_bytes(4, "big") + labels[8 : 8 + 7000])

    digits = case.damaged_digits(keep_7000_labels)
    return ["--data.data_dir", str(digits)], [f"{IMAGES} holds 8,000 images", f"{LABELS} 7,000 labels"]


def resume_after_changing_the_model(case: Case) -> tuple[list[str], list[str]]:
    """`ckpt_path: last` (the config's) in a run directory whose checkpoint has hidden: 128."""
    shutil.copytree(case.trained_run(), case.run_dir)
    last = case.run_dir / "checkpoints" / "last.ckpt"
    return ["--model.hidden", "64"], [f"checkpoint {last} does not fit the model",
                                      "net.classifier.2.weight is 128x3136 in the checkpoint, 64x3136 in the model",
                                      "new run directory", "ckpt_path"]  # fmt: skip


def resume_past_max_epochs(case: Case) -> tuple[list[str], list[str]]:
    """`ckpt_path: last` in a run directory that trained 3 epochs, with max_epochs 1 (as 3 after 10 would be)."""
    shutil.copytree(case.trained_run("three_epoch_run"), case.run_dir)
    last = case.run_dir / "checkpoints" / "last.ckpt"
    return [], [f"checkpoint {last} had finished 3 epochs, past trainer.max_epochs 1", "new run directory"]


def checkpoint_of_another_network(case: Case) -> tuple[list[str], list[str]]:
    """An explicit `--ckpt_path` whose network had 12 outputs (Lightning takes the other settings from it)."""
    checkpoint = torch.load(case.trained_run() / "checkpoints" / "last.ckpt", weights_only=True)
    checkpoint["state_dict"]["net.classifier.5.weight"] = torch.zeros(12, 128)
    checkpoint["state_dict"]["net.classifier.5.bias"] = torch.zeros(12)
    other = case.tmp_path / "other-network.ckpt"
    torch.save(checkpoint, other)
    return ["--ckpt_path", str(other)], [f"checkpoint {other} does not fit the model",
                                         "net.classifier.5.weight is 12x128 in the checkpoint, 10x128 in the model",
                                         "new run directory", "ckpt_path"]  # fmt: skip


CHECKED_BEFORE_ANYTHING_STARTS = [
    unknown_key, abbreviated_option, unknown_key_in_yaml, wrong_type_in_yaml, unknown_key_in_a_model_file,
    wrong_type_in_a_file_a_config_names, missing_config_file, unknown_class_path, unknown_class_path_in_yaml,
    yaml_syntax_error, empty_yaml, batch_size_zero, dropout_above_one,
]  # fmt: skip
CHECKED_WHEN_THE_RUN_STARTS = [
    trainer_setting_lightning_refuses, negative_learning_rate, truncated_images, garbage_images,
    fewer_labels_than_images, resume_after_changing_the_model, resume_past_max_epochs, checkpoint_of_another_network,
]  # fmt: skip


def run_record(run_dir: Path) -> dict[Path, int]:
    """When each checkpoint, and the config of the run that saved them, was last written."""
    return {path: path.stat().st_mtime_ns for path in [*run_dir.rglob("*.ckpt"), *run_dir.glob("config.yaml")]}


@pytest.mark.parametrize(
    "bad_input", CHECKED_BEFORE_ANYTHING_STARTS + CHECKED_WHEN_THE_RUN_STARTS, ids=lambda case: case.__name__
)
def test_bad_input_is_refused_in_one_line(bad_input, default_project, real_mnist, tmp_path, request):
    case = Case(tmp_path, real_mnist, request)
    more, says = bad_input(case)
    before = run_record(case.run_dir)

    ending = run_project(default_project, *fit(case.digits, case.run_dir, *more))

    first = bad_input in CHECKED_BEFORE_ANYTHING_STARTS
    assert_refused(ending, CONFIG_ERROR, says[0], within=WITHIN_SECONDS, first=first)
    for part in says[1:]:
        assert part in ending.error_lines[0], ending.tail()
    assert "usage:" not in ending.stderr, "the usage text is for --help"
    assert run_record(case.run_dir) == before, "a checkpoint, or the run's config.yaml, was written or changed"
