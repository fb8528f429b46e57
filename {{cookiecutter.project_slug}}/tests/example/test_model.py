import csv
import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset
from trainkit.cli import ProjectCLI

from {{ cookiecutter.package_name }}.data.mnist import MNISTDataModule
from {{ cookiecutter.package_name }}.models.image_classifier import ConvNet, ImageClassifier

from .conftest import THE_EXAMPLE
from .fake_mnist import fake_digits


def normalised_batch(count: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = fake_digits(count, seed=0)
    return images.unsqueeze(1).float() / 255, labels.long()


def test_convnet_returns_logits_per_class():
    logits = ConvNet()(torch.zeros(5, 1, 28, 28))
    assert logits.shape == (5, 10)


def test_channels_classes_and_image_size_are_the_data_modules():
    # Three-channel 32x32 images in 7 classes, as another data module would give them.
    model = ImageClassifier(in_channels=3, num_classes=7)
    images, labels = torch.rand(4, 3, 32, 32), torch.tensor([0, 3, 6, 6])
    assert model(images).shape == (4, 7)
    loss = model.training_step((images, labels), batch_idx=0)
    assert loss.dim() == 0 and torch.isfinite(loss)
    with pytest.raises(RuntimeError):  # one channel where three are expected: refused, not reinterpreted
        model(torch.rand(4, 1, 32, 32))


class ColourImages(LightningDataModule):
    """Random 3-channel 32x32 images in 7 classes: a data module other than MNIST."""

    in_channels = 3
    num_classes = 7

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.rand(8, 3, 32, 32), torch.randint(0, 7, (8,))), batch_size=4)

    val_dataloader = train_dataloader


def test_the_command_line_gives_the_model_the_data_modules_channels_and_classes(tmp_path):
    args = ["fit", *THE_EXAMPLE, "--data", f"{__name__}.ColourImages",
            "--trainer.fast_dev_run", "true", "--trainer.accelerator", "cpu", "--trainer.logger", "false",
            "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path)]  # fmt: skip
    cli = ProjectCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True, args=args)
    assert (cli.model.hparams.in_channels, cli.model.hparams.num_classes) == (3, 7)
    assert cli.trainer.state.finished  # it trained on them


def test_training_step_returns_scalar_loss():
    model = ImageClassifier()
    loss = model.training_step(normalised_batch(), batch_idx=0)
    assert loss.dim() == 0 and torch.isfinite(loss)


def test_a_few_steps_reduce_the_loss():
    torch.manual_seed(0)
    model = ImageClassifier(dropout=0.0)
    optimizer = model.configure_optimizers()
    batch = normalised_batch(64)
    losses = []
    for _ in range(20):
        optimizer.zero_grad()
        loss = model.training_step(batch, batch_idx=0)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_optimizer_and_scheduler_are_injected():
    model = ImageClassifier(
        optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
        scheduler=lambda optimizer: StepLR(optimizer, step_size=1, gamma=0.1),
    )
    configured = model.configure_optimizers()
    assert isinstance(configured["optimizer"], torch.optim.SGD)
    assert configured["optimizer"].param_groups[0]["lr"] == 0.5
    assert isinstance(configured["lr_scheduler"], StepLR)


def test_fit_reports_loss_and_accuracy_for_training_and_validation(mnist_dir, tmp_path):
    trainer = Trainer(accelerator="cpu", max_epochs=1, limit_train_batches=4, limit_val_batches=2, logger=False,
                      log_every_n_steps=2, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(ImageClassifier(), MNISTDataModule(data_dir=str(mnist_dir), download=False, batch_size=32))
    metrics = trainer.callback_metrics
    assert {"train/loss", "train/acc", "val/loss", "val/acc"} <= metrics.keys()
    assert 0 <= metrics["train/acc"] <= 1 and 0 <= metrics["val/acc"] <= 1


class StepLosses(Callback):
    """Each optimizer step's training loss, as training_step returned it."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].item())


def test_the_logger_records_every_nth_steps_own_loss(mnist_dir, tmp_path):
    # The loss is logged only on the steps the logger records; over two epochs of 5 steps, with
    # logging every 3 steps, those are steps 2, 5 and 8 (0-based), each with its own loss.
    losses = StepLosses()
    trainer = Trainer(accelerator="cpu", max_epochs=2, limit_train_batches=5, limit_val_batches=1,
                      log_every_n_steps=3, logger=CSVLogger(tmp_path), callbacks=[losses],
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(ImageClassifier(), MNISTDataModule(data_dir=str(mnist_dir), download=False, batch_size=32))
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as file:
        logged = {int(row["step"]): float(row["train/loss"]) for row in csv.DictReader(file) if row["train/loss"]}
    assert sorted(logged) == [2, 5, 8]
    assert logged == pytest.approx({step: losses.losses[step] for step in (2, 5, 8)})


def test_predict_step_gives_class_and_confidence():
    model = ImageClassifier().eval()
    images, labels = normalised_batch(8)
    with torch.no_grad():
        out = model.predict_step((images, labels), batch_idx=0)
    assert out["predicted"].shape == (8,) and out["predicted"].max() < 10
    assert ((out["confidence"] > 0) & (out["confidence"] <= 1)).all()
    assert torch.equal(out["label"], labels)


@pytest.fixture
def compiled_graphs(monkeypatch) -> list[torch.fx.GraphModule]:
    """The graphs `torch.compile` captures from now on, run as captured (no code generation: fast on CPU)."""
    graphs = []

    def record(graph: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(graph)
        return graph.forward

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda *args, **kwargs: real_compile(*args, **kwargs, backend=record))
    torch._dynamo.reset()
    yield graphs
    torch._dynamo.reset()


@pytest.mark.parametrize("compile", [True, False])
def test_compile_option_compiles_the_network_in_place(compile, compiled_graphs):
    torch.manual_seed(0)
    model = ImageClassifier(dropout=0.0, compile=compile)
    eager = ConvNet(dropout=0.0)
    eager.load_state_dict(model.net.state_dict())
    model.configure_model()  # Lightning calls this before fit, validate, test and predict

    images, labels = normalised_batch(8)
    assert torch.allclose(model(images), eager(images), atol=1e-6)
    assert bool(compiled_graphs) == compile
    # Compiled in place: checkpoints of compiled and plain runs load into each other.
    assert model.net.state_dict().keys() == eager.state_dict().keys()
    loss = model.training_step((images, labels), batch_idx=0)
    loss.backward()
    assert all(parameter.grad is not None for parameter in model.net.parameters())


def test_the_example_trains_sharded_with_each_process_holding_half_of_every_block(two_sharded_processes):
    # The same model class as under DDP and on one device: its configure_model shards it when there is a mesh.
    reports = [json.loads(path.read_text()) for path in sorted((two_sharded_processes / "reports").glob("rank*.json"))]
    assert len(reports) == 2 and reports[0]["weights"] == reports[1]["weights"]
    assert [report["parameters_held"] * 2 for report in reports] == [reports[0]["parameters"]] * 2
    checkpoint = two_sharded_processes / "run" / "checkpoints" / "last.ckpt"
    assert sorted(path.name for path in checkpoint.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
