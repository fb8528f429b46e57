"""Make it yours: a model and images of the researcher's own, trained by a generated project without editing it.

A project is generated and a model module of this test's own is added to it (a new file,
`models/tiny_resnet.py`, and its `configs/model/tiny_resnet.yaml`). The shipped real digits are
written as PNG files, 32x32 RGB, in class folders (`train/<class>/*.png`, `val/...`, `test/...`),
which the project's image-folder data module reads through its config. The model trains on them
in memory on one process and on two (gloo), and a run stopped by SIGTERM mid-epoch ends, once the
same command has run again, with the weights of the run that was never stopped. Then the folder,
whose files are sorted by class, is converted into chunks by the project's command and streamed,
and the held-out accuracy is that of the in-memory run.

On another fresh project the README's steps 4 and 5 are followed to the letter: configs/experiment.yaml
names that model and the image-folder data, the example's files are deleted, and the project's own tests
(its configs, checked with the researcher's model and data) pass.
"""

import json
import math
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from litdata import StreamingDataset
from PIL import Image

from mnist_sample import IMAGES, LABELS, idx_items, read_verified  # scripts/, on the path from conftest.py

from .launch_runs import launch_environment

# Of the shipped 10,000 digits: 4,000 to train on, 500 to validate on, 2,000 held out.
SPLITS = {"train": range(0, 4000), "val": range(4000, 4500), "test": range(8000, 10000)}
EPOCHS = 4

MODEL = '''"""A researcher's own model, added to the project as a file of its own: a small residual network."""

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn


class Residual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(), nn.Conv2d(channels, channels, 3, padding=1)
        )

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x + self.body(x))


class TinyResNet(LightningModule):
    def __init__(self, in_channels: int = 3, num_classes: int = 10, width: int = 16, lr: float = 0.005) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Conv2d(in_channels, width // 2, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(width // 2, width, 3, stride=2, padding=1), nn.ReLU(),
            Residual(width),
            nn.AdaptiveAvgPool2d(8), nn.Flatten(), nn.Linear(width * 64, num_classes),
        )  # fmt: skip

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, labels = batch
        loss = F.cross_entropy(self.net(images), labels)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def _evaluate(self, batch: tuple[Tensor, Tensor], stage: str) -> None:
        images, labels = batch
        correct = (self.net(images).argmax(dim=1) == labels).float().mean()
        self.log(f"{stage}/acc", correct, batch_size=len(labels), sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        steps = self.trainer.estimated_stepping_batches
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.hparams.lr, total_steps=steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
'''

MODEL_CONFIG = """# A model of the researcher's own; in_channels and num_classes come from the data module.
class_path: {package}.models.tiny_resnet.TinyResNet
init_args:
  width: 16
  lr: 0.005
"""


@pytest.fixture(scope="module")
def project(cookies_session) -> Path:
    """A project of its own (the shared ones stay untouched), with the researcher's model added."""
    return project_with_own_model(cookies_session)


def project_with_own_model(cookies_session) -> Path:
    """A freshly generated project and the researcher's model: two new files, no generated file edited."""
    result = cookies_session.bake()
    assert result.exit_code == 0, result.exception
    project = result.project_path
    package = project.name.replace("-", "_")
    (project / "src" / package / "models" / "tiny_resnet.py").write_text(MODEL)
    (project / "configs" / "model" / "tiny_resnet.yaml").write_text(MODEL_CONFIG.format(package=package))
    return project


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory) -> Path:
    """The shipped digits as 32x32 RGB PNG files in class folders: each digit drawn in a colour of its own."""
    root = tmp_path_factory.mktemp("images")
    dims, pixels = idx_items(read_verified(IMAGES))
    images = torch.frombuffer(bytearray(pixels), dtype=torch.uint8).view(dims)
    labels = idx_items(read_verified(LABELS))[1]
    colours = torch.randint(96, 256, (len(labels), 3, 1, 1), generator=torch.Generator().manual_seed(0))
    for split, ids in SPLITS.items():
        for index in ids:
            padded = torch.nn.functional.pad(images[index], (2, 2, 2, 2))  # 28x28 -> 32x32
            folder = root / split / str(labels[index])
            folder.mkdir(parents=True, exist_ok=True)
            coloured = (padded * colours[index] // 255).to(torch.uint8)  # 3x32x32
            Image.fromarray(coloured.permute(1, 2, 0).numpy()).save(folder / f"{index:05d}.png")
    return root


def load(checkpoint: Path) -> dict:
    return torch.load(checkpoint, map_location="cpu", weights_only=True)


def project_command(project: Path, *args: str) -> str:
    """`python ARGS` in the project, as a user runs it; its output."""
    result = subprocess.run([sys.executable, *args], cwd=project, env=launch_environment(project),
                            capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result.stdout + result.stderr


def experiment(run_dir: Path, *data: str) -> list[str]:
    """The project's experiment with the researcher's model, on CPU, logging to CSV files."""
    return ["--config", "configs/experiment.yaml", "--config", "configs/loggers/csv.yaml",
            "--model", "configs/model/tiny_resnet.yaml", *data, "--data.batch_size", "32",
            "--trainer.accelerator", "cpu", "--trainer.max_epochs", str(EPOCHS),
            "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(run_dir)]  # fmt: skip


def fit_and_test(project: Path, run_dir: Path, *args: str) -> float:
    """`fit`, then `test` of the last checkpoint: the held-out accuracy."""
    project_command(project, "train.py", "fit", *experiment(run_dir, *args))
    tested = project_command(project, "train.py", "test", *experiment(run_dir, *args),
                             "--ckpt_path", str(run_dir / "checkpoints" / "last.ckpt"))  # fmt: skip
    return float(re.search(r"test/acc\W+([0-9.]+)", tested).group(1))


def in_memory(image_folder: Path) -> list[str]:
    return ["--data", "configs/data/image_folder.yaml", "--data.root", str(image_folder)]


@pytest.fixture(scope="module")
def in_memory_run(project, image_folder, tmp_path_factory) -> tuple[Path, float]:
    """The in-memory run on one process: its run directory and its held-out accuracy."""
    run_dir = tmp_path_factory.mktemp("run") / "in-memory"
    return run_dir, fit_and_test(project, run_dir, *in_memory(image_folder))


@pytest.fixture(scope="module")
def in_memory_accuracy(in_memory_run) -> float:
    return in_memory_run[1]


def test_own_model_learns_own_images_in_memory(in_memory_accuracy):
    assert in_memory_accuracy >= 0.93


def test_sigterm_mid_epoch_then_the_same_command_trains_the_same_weights(
    project, image_folder, in_memory_run, tmp_path
):
    run_dir, log, marker = tmp_path / "run", tmp_path / "interrupted.log", tmp_path / "step-150"
    fit = ["train.py", "fit", *experiment(run_dir, *in_memory(image_folder))]
    paced = ["--trainer.callbacks+=trainkit.testing.pacing.PaceSteps", "--trainer.callbacks.marker", str(marker),
             "--trainer.callbacks.at_step", "150", "--trainer.callbacks.seconds_per_step", "0.05"]  # fmt: skip
    with log.open("w") as output:
        job = subprocess.Popen([sys.executable, *fit, *paced], cwd=project, env=launch_environment(project),
                               stdout=output, stderr=subprocess.STDOUT)  # fmt: skip
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.1)
        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=120) == 143, log.read_text()[-4000:]
    steps_per_epoch = math.ceil(len(SPLITS["train"]) / 32)
    stopped_at = load(run_dir / "checkpoints" / "preempted.ckpt")["global_step"]
    assert stopped_at % steps_per_epoch, "the interruption must land mid-epoch"

    resumed = project_command(project, *fit)
    assert "preempted.ckpt" in resumed and "not resumable" not in resumed, resumed[-4000:]  # Lightning's warning
    expected, actual = (load(run / "checkpoints" / "last.ckpt") for run in (in_memory_run[0], run_dir))
    assert actual["global_step"] == expected["global_step"] == EPOCHS * steps_per_epoch
    for name, tensor in expected["state_dict"].items():
        assert torch.equal(tensor, actual["state_dict"][name]), f"{name} differs from the uninterrupted run's"


def test_two_processes_share_the_images(project, image_folder, tmp_path):
    run_dir = tmp_path / "run"
    output = project_command(project, "train.py", "fit", *experiment(run_dir, *in_memory(image_folder)),
                             "--trainer.devices", "2")  # fmt: skip
    assert "world_size=2" in output
    checkpoint = load(run_dir / "checkpoints" / "last.ckpt")
    steps_per_epoch = math.ceil(len(SPLITS["train"]) / 2 / 32)  # each process its half, 32 images a batch
    assert checkpoint["global_step"] == EPOCHS * steps_per_epoch
    best = checkpoint["callbacks"][next(key for key in checkpoint["callbacks"] if "val/acc" in key)]["best_model_score"]
    print(f"best validation accuracy on 2 processes: {best:.2%}")
    assert best >= 0.9


def test_chunks_of_the_folder_stream_as_well_as_it_trains_in_memory(
    project, image_folder, in_memory_accuracy, tmp_path
):
    chunks = tmp_path / "chunks"
    # Small chunks, so that a class-sorted order would leave whole chunks of one class.
    project_command(project, "-m", "trainkit.chunks", "--config", "configs/experiment.yaml",
                    *in_memory(image_folder), "--out", str(chunks), "--chunk_bytes", "200KB",
                    "--workers", "2")  # fmt: skip
    assert len(json.loads((chunks / "train" / "index.json").read_text())["chunks"]) > 5
    stored = StreamingDataset(str(chunks / "train"))  # in the order the chunks hold them
    first = [stored[index]["label"] for index in range(100)]
    assert len(set(first)) == 10, f"the training samples are stored in class order: {first}"

    streamed = ["--data", "configs/data/streaming_images.yaml", "--data.input_dir", str(chunks)]
    streamed_accuracy = fit_and_test(project, tmp_path / "run", *streamed)
    print(f"held-out accuracy: {in_memory_accuracy:.2%} in memory, {streamed_accuracy:.2%} streamed")
    assert abs(streamed_accuracy - in_memory_accuracy) <= 0.02


PREPARE_OWN_SAMPLE = """
    @classmethod
    def prepare(cls, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, ...]:
        return ("--data.root", "{root}")  # a sample of the researcher's images


"""


def deleted_by_step_5(project: Path) -> list[Path]:
    """The files and folders the README's "Delete the example" step names, as paths in the project."""
    readme = (project / "README.md").read_text()
    step = re.search(r"^5\. \*\*Delete the example\*\*(.*?)\n\n", readme, re.MULTILINE | re.DOTALL).group(1)
    package = project / "src" / project.name.replace("-", "_")
    named = re.findall(r"`([^`]+)`", step.split(". Add tests of your own")[0])
    return [(package if name.startswith(("models/", "data/")) else project) / name for name in named]


def rewrite_the_sweep(project: Path, parameters: dict) -> None:
    """README step 4: configs/sweep.yaml's parameters, which name the example model's options, rewritten."""
    sweep = project / "configs" / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({**yaml.safe_load(sweep.read_text()), "parameters": parameters}, sort_keys=False))


def test_the_projects_tests_pass_once_the_example_is_deleted(cookies_session, image_folder):
    """README steps 4 and 5 on a fresh project: the experiment names the researcher's model and data, the example
    goes, and the project's own suite passes."""
    project = project_with_own_model(cookies_session)

    experiment = project / "configs" / "experiment.yaml"  # step 4
    text = experiment.read_text()
    assert "model: model/image_classifier.yaml\ndata: data/mnist.yaml\n" in text
    text = text.replace("model: model/image_classifier.yaml", "model: model/tiny_resnet.yaml")
    text = text.replace("data: data/mnist.yaml", "data: data/image_folder.yaml")
    experiment.write_text(text.replace("default_root_dir: runs/experiment", "default_root_dir: runs/tiny_resnet"))
    rewrite_the_sweep(project, {"model.lr": {"distribution": "log_uniform_values", "min": 0.001, "max": 0.01},
                                "model.width": {"values": [8, 16, 32]}})  # fmt: skip

    deleted = deleted_by_step_5(project)  # step 5
    assert {path.name for path in deleted} >= {"image_classifier.py", "mnist.py", "image_classifier.yaml", "example"}
    for path in deleted:
        assert path.exists(), f"the README names {path}, which the project does not have"
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()

    printed = project_command(project, "train.py", "fit", "--config", "configs/experiment.yaml", "--print_config")
    assert "TinyResNet" in printed and "ImageFolderDataModule" in printed

    # Step 5 too: the contract's `prepare` gives a sample of the researcher's images instead of fake digits.
    your_code = project / "tests" / "test_your_code.py"
    own_sample = PREPARE_OWN_SAMPLE.format(root=image_folder)
    text = re.sub(r"\n    # The example's digits.*?\n\n\n", own_sample, your_code.read_text(), flags=re.DOTALL)
    your_code.write_text(text.replace("from .example.fake_mnist import write_fake_mnist\n", ""))

    def project_tests(*args: str, counted: str = "passed") -> int:
        """The project's own `pytest ARGS`, which must pass: how many tests it says were `counted`."""
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
        env = launch_environment(project)
        result = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=1800)
        assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-3000:]
        return int(re.search(rf"(\d+) (?:tests )?{counted}", result.stdout).group(1))

    # The project's own tests now check the researcher's configs, model and data: the experiment and each config
    # on top of it, and the model and data the experiment names through the kit's guarantees.
    configs = [path for path in (project / "configs").rglob("*.yaml")
               if path.name not in ("experiment.yaml", "sweep.yaml")]  # fmt: skip
    assert project_tests("tests/test_configs.py") == 2 + len(configs)  # and one draw of the sweep's parameters
    assert project_tests("tests/test_your_code.py") == 5  # the fast contract's six but predict, the example's alone
