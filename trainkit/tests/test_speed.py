import json
import logging
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from jsonargparse import Namespace
from lightning.fabric.accelerators.cuda import _check_cuda_matmul_precision
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning_utilities.core import rank_zero

from trainkit.checkpoints import agreement, preemption
from trainkit.cli import ProjectCLI
from trainkit.run import speed
from trainkit.run.errors import ConfigError
from trainkit.run.quiet import LeaveOut

from .helpers import quick_run_args, run_train


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
    missing = Namespace(accelerator="auto", precision=None, strategy="auto")
    speed.use_fast_defaults(missing)
    assert missing.precision == "bf16-mixed"
    chosen = Namespace(accelerator="auto", precision="32-true", strategy="ddp_fork")
    speed.use_fast_defaults(chosen)
    assert chosen.precision == "32-true"


@pytest.mark.parametrize("strategy", ["ddp_notebook", Namespace(class_path="DDPStrategy", init_args=Namespace(
    start_method="fork"))], ids=["by name", "by start_method"])  # fmt: skip
def test_a_strategy_that_forks_must_be_given_the_precision_on_a_gpu(monkeypatch, strategy):
    pretend_gpu(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda **kwargs: pytest.fail("asked the GPU: CUDA started"))
    with pytest.raises(ConfigError, match=r"^trainer.precision: set it \(bf16-mixed or 32-true\) with a strategy that"):
        speed.use_fast_defaults(Namespace(accelerator="auto", precision=None, strategy=strategy))
    on_the_cpu = Namespace(accelerator="cpu", precision=None, strategy=strategy)
    speed.use_fast_defaults(on_the_cpu)
    assert on_the_cpu.precision == "32-true"


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


@pytest.mark.usefixtures("matmul_precision")
@pytest.mark.parametrize(("precision", "advised"), [("high", False), ("highest", True)])
def test_lightnings_advice_to_set_the_matmul_precision_is_left_out_where_the_callback_sets_it(
    monkeypatch, precision, advised
):
    # Lightning gives its advice when it sets up the GPU, which comes before the callbacks' setup.
    pretend_gpu(monkeypatch, capability=(9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU with TF32")
    torch.set_float32_matmul_precision("highest")
    logger, said = rank_zero.log, []  # the logger Lightning's rank_zero_info lines go to
    handler = logging.Handler(logging.INFO)
    handler.emit = said.append
    logger.addHandler(handler)
    try:
        speed.Float32MatmulPrecision(precision)
        _check_cuda_matmul_precision.__wrapped__(torch.device("cuda", 0))
    finally:
        logger.removeHandler(handler)
        logger.removeFilter(LeaveOut(speed.MATMUL_ADVICE))  # for the tests after this one
    assert [record.getMessage().startswith("You are using a CUDA device") for record in said] == [advised] * advised


def test_matmul_precision_must_be_one_torch_knows():
    with pytest.raises(ValueError, match="'highest', 'high' or 'medium'"):
        speed.Float32MatmulPrecision("tf32")


class CountSteps(Callback):
    """Counts the step hooks Lightning calls on it: it defines only on_train_batch_end."""

    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, *args: Any) -> None:
        self.batches += 1


def test_lightning_skips_the_step_hooks_a_callback_leaves_empty(tmp_path):
    counted, untouched = CountSteps(), Callback()
    trainer = Trainer(accelerator="cpu", max_steps=3, limit_val_batches=0, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                      callbacks=[speed.SkipEmptyHooks(), counted, untouched])  # fmt: skip
    trainer.fit(BoringModel())
    # SkipEmptyHooks relies on Lightning skipping a hook that is not callable: a step with them set to None runs.
    assert counted.batches == 3 and counted.on_train_batch_end is not None
    assert all(getattr(untouched, hook) is None for hook in speed.STEP_HOOKS)
    assert counted.on_after_backward is None and untouched.on_fit_start is not None  # only the step hooks


def test_lightning_still_has_the_per_step_sigterm_broadcast_that_preemption_switches_off():
    # PreemptionCheckpoint replaces this method for each run (see its on_train_start). If a
    # Lightning release renames or drops it, that line is dead: remove it, or switch off the new one.
    assert callable(getattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor", None))


# Tensor methods that hand a tensor's value to Python or copy it to the CPU: on a GPU each waits until
# the GPU has run everything queued before it, so the CPU stops queueing work ahead.
READS_A_VALUE = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class CountHostSyncs(Callback):
    """Record, per training step, the kit's own calls that would make the CPU wait for a GPU.

    Those are the READS_A_VALUE methods on any tensor, and `torch.tensor(..., device=...)` (a copy to the
    device, which waits as well from ordinary memory). A call is the kit's when the first caller outside
    torch (and torchmetrics) is a module of `trainkit`, its test helpers (the model's role) aside; Lightning's
    own calls are not counted. Steps `from_step` on, validation and epoch ends left out (they read
    scores and save checkpoints). Each process writes `out_dir/rank<N>.json`: {step: [caller, ...]}.
    """

    def __init__(self, out_dir: str, from_step: int = 2) -> None:
        self.out_dir = Path(out_dir)
        self.from_step = from_step
        self.calls: dict[int, list[str]] = {}
        self.step: int | None = None  # the step being counted, None while not counting
        self._originals: dict[str, Any] = {}

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for name in READS_A_VALUE:
            self._wrap(torch.Tensor, name, lambda *args, **kwargs: True)
        self._wrap(torch, "tensor", lambda *args, device=None, **kwargs: device is not None)

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        step = trainer.global_step + 1
        self.step = step if step >= self.from_step else None
        if self.step is not None:
            self.calls[self.step] = []

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.step = None

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.step = None

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.step = None
        for (owner, name), original in self._originals.items():
            setattr(owner, name, original)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.calls))

    def _wrap(self, owner: Any, name: str, counts: Callable[..., bool]) -> None:
        original = getattr(owner, name)
        self._originals[owner, name] = original

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self.step is not None and counts(*args, **kwargs):
                caller = _kit_caller(sys._getframe(1))
                if caller is not None:
                    self.calls[self.step].append(f"{name} from {caller}")
            return original(*args, **kwargs)

        setattr(owner, name, wrapper)


def _kit_caller(frame: Any) -> str | None:
    while frame is not None and frame.f_globals.get("__name__", "").startswith("torch"):
        frame = frame.f_back
    module = "" if frame is None else frame.f_globals.get("__name__", "")
    if module.startswith("trainkit.") and not module.startswith("trainkit.testing"):
        return f"{module}:{frame.f_lineno} ({frame.f_code.co_name})"
    return None


@pytest.mark.parametrize("devices", [1, 2])
def test_the_kits_training_steps_never_wait_for_the_device(devices, experiment, tmp_path):
    # Every callback of the defaults and the command line, 3 epochs of 4 steps: the steps that end an epoch
    # are counted, and the 10th, where the periodic checkpoint's processes compare clocks. Fewer steps than
    # log_every_n_steps: at a logging step Lightning reads the logged values itself, and the progress
    # lines print them.
    out = tmp_path / "calls"
    args = [*quick_run_args(experiment, tmp_path / "run"), "--trainer.max_epochs", "3", "--trainer.devices",
            str(devices), "--trainer.callbacks+=tests.test_speed.CountHostSyncs", "--trainer.callbacks.out_dir",
            str(out)]  # fmt: skip
    result = run_train("fit", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in range(devices):
        calls = json.loads((out / f"rank{rank}.json").read_text())
        assert list(calls) == [str(step) for step in range(2, 13)]  # every step counted
        waits = {step: found for step, found in calls.items() if found}
        assert waits == {}, f"process {rank}: calls that wait for the device, per step: {waits}"


@pytest.fixture
def one_process_group(tmp_path):
    """A gloo process group of this process alone, and a fresh cache of the kit's gloo group."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    agreement._gloo_group = None
    yield
    dist.destroy_process_group()
    agreement._gloo_group = None


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_processes_agree_on_the_cpu_over_gloo_beside_any_backend(monkeypatch, backend):
    made = []

    def new_group(*args: Any, **kwargs: Any) -> dist.ProcessGroup:
        made.append(kwargs)
        return original_new_group(*args, **kwargs)

    original_new_group = dist.new_group
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "new_group", new_group)
    agreements = [agreement.Agreement(size=2), agreement.Agreement()]
    for each in agreements:
        each.start(timedelta(seconds=42))
    # On gloo the job's own group; beside NCCL one gloo group, made once, with the job's timeout.
    assert made == ([] if backend == "gloo" else [{"backend": "gloo", "timeout": timedelta(seconds=42)}])
    assert all(each.shared for each in agreements) and agreements[0]._group is agreements[1]._group
    assert (agreements[0]._group is None) == (backend == "gloo")
    stop = agreements[0]
    stop.propose(143, 52_000)
    assert stop.pending and stop._tensor.device.type == "cpu"
    assert stop.agreed() == (143, 52_000) and not stop.pending
    stop.propose(0, 7)
    stop.finish()
    assert stop.agreed() == (0, 7)
    with pytest.raises(ValueError, match="2 numbers to propose, got 1"):
        stop.propose(143)


@pytest.mark.parametrize(("step_seconds", "steps"), [
    (0, 1),  # not measured yet: every step
    (0.001, 100),  # 1 ms steps: at most 100 steps between agreements
    (0.02, 25),  # 0.5 s of 20 ms steps
    (0.2, 2),
    (0.3, 1),
    (3.0, 1),  # steps longer than 0.5 s: every step
])  # fmt: skip
def test_processes_agree_every_half_second_of_training_or_every_step(step_seconds, steps):
    assert preemption.steps_between_agreements(round(step_seconds * 1e6)) == steps
