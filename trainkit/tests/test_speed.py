from types import SimpleNamespace

import pytest
import torch
from jsonargparse import Namespace
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

from trainkit.cli import ProjectCLI
from trainkit.run import speed


def pretend_gpu(monkeypatch, bf16: str | None = "native", capability: tuple[int, int] = (8, 0)) -> None:
    """Make torch report a GPU: bf16 "native", "emulated" or None; `capability` its compute capability."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        return bf16 == "native" or (bf16 == "emulated" and including_emulation)

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)


@pytest.fixture
def matmul_precision():
    """Restore torch's process-wide float32 matmul precision after the test."""
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("accelerator", ["auto", "gpu", "cuda"])
def test_gpus_with_native_bf16_train_in_bf16_mixed(monkeypatch, accelerator):
    pretend_gpu(monkeypatch, bf16="native")
    assert speed.default_precision(accelerator) == "bf16-mixed"


@pytest.mark.parametrize("bf16", ["emulated", None])
def test_gpus_without_native_bf16_train_in_32_bit(monkeypatch, bf16):
    pretend_gpu(monkeypatch, bf16=bf16)
    assert speed.default_precision("auto") == "32-true"


def test_the_cpu_trains_in_32_bit(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert speed.default_precision("auto") == speed.default_precision("cpu") == "32-true"
    pretend_gpu(monkeypatch)
    assert speed.default_precision("cpu") == "32-true"  # a GPU in the machine, but not asked for


def test_fast_defaults_fill_in_only_a_missing_precision(monkeypatch):
    pretend_gpu(monkeypatch)
    missing = Namespace(accelerator="auto", precision=None)
    speed.use_fast_defaults(missing)
    assert missing.precision == "bf16-mixed"
    chosen = Namespace(accelerator="auto", precision="32-true")
    speed.use_fast_defaults(chosen)
    assert chosen.precision == "32-true"


def test_the_cli_applies_the_default_precision_unless_the_config_sets_one(monkeypatch, tmp_path):
    monkeypatch.setattr(speed, "default_precision", lambda accelerator: "bf16-mixed")  # as on a recent GPU

    def precision_of_a_run(*extra: str) -> str:
        args = ["validate", "--model", "trainkit.testing.tiny.TinyClassifier",
                "--data", "trainkit.testing.tiny.TinyDataModule",
                "--trainer.accelerator", "cpu", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
                "--trainer.limit_val_batches", "1", "--trainer.default_root_dir", str(tmp_path), *extra]  # fmt: skip
        cli = ProjectCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                         args=args, save_config_kwargs={"overwrite": True})  # fmt: skip
        return cli.trainer.precision

    assert precision_of_a_run() == "bf16-mixed"
    assert precision_of_a_run("--trainer.precision", "32-true") == "32-true"


def trainer_on(device: str) -> SimpleNamespace:
    return SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device(device)))


@pytest.mark.usefixtures("matmul_precision")
@pytest.mark.parametrize(("device", "capability", "expected"), [
    ("cuda", (8, 0), "high"),  # Ampere and newer have TF32
    ("cuda", (7, 5), "highest"),  # Turing has not
    ("cpu", (8, 0), "highest"),  # the CPU is left alone, whatever GPU the machine has
])  # fmt: skip
def test_tf32_matmuls_only_on_gpus_that_have_them(monkeypatch, device, capability, expected):
    pretend_gpu(monkeypatch, capability=capability)
    torch.set_float32_matmul_precision("highest")
    speed.Float32MatmulPrecision().setup(trainer_on(device), pl_module=None, stage="fit")
    assert torch.get_float32_matmul_precision() == expected


def test_matmul_precision_must_be_one_torch_knows():
    with pytest.raises(ValueError, match="'highest', 'high' or 'medium'"):
        speed.Float32MatmulPrecision("tf32")


def test_lightning_still_has_the_per_step_sigterm_broadcast_that_preemption_switches_off():
    # PreemptionCheckpoint replaces this method for each run (see its on_train_start). If a
    # Lightning release renames or drops it, that line is dead: remove it, or switch off the new one.
    assert callable(getattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor", None))
