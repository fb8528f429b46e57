"""Fast defaults for the GPU a run lands on. Each one can be switched off in the config.

- Mixed precision: when the config leaves `trainer.precision` out, a GPU that computes in
  bfloat16 natively (Ampere and newer) trains in `bf16-mixed`, anything else (the CPU too) in
  `32-true`. Set `trainer.precision` to choose yourself.
- TF32: the `Float32MatmulPrecision` callback in the kit's defaults (defaults.yaml) lets float32 matrix
  multiplications use TF32 tensor cores on GPUs that have them. Remove it to keep full float32.
- Hooks: the `SkipEmptyHooks` callback spares each step Lightning's calls of hooks that do nothing.
"""

import torch
from jsonargparse import Namespace
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import StrategyRegistry

from trainkit.run.errors import ConfigError
from trainkit.run.quiet import leave_out_lightning_lines

GPU_ACCELERATORS = ("auto", "gpu", "cuda")  # the `trainer.accelerator` values that train on a GPU when there is one
# What Lightning's advice to set the float32 matmul precision says (Float32MatmulPrecision sets it).
MATMUL_ADVICE = "torch.set_float32_matmul_precision("
# The callback hooks Lightning calls at every training step.
STEP_HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
              "on_before_zero_grad", "on_train_batch_end")  # fmt: skip


def trains_on_a_gpu(accelerator: str) -> bool:
    """Whether `accelerator` means a GPU here. Lightning counts GPUs with NVML: CUDA is not started."""
    return accelerator in GPU_ACCELERATORS and torch.cuda.is_available()


def default_precision(accelerator: str) -> str:
    """`bf16-mixed` where `accelerator` means a GPU with native bfloat16, else `32-true`."""
    # Older GPUs emulate bfloat16, slower than float32: only native support counts.
    if trains_on_a_gpu(accelerator) and torch.cuda.is_bf16_supported(including_emulation=False):
        return "bf16-mixed"
    return "32-true"


def use_fast_defaults(trainer: Namespace) -> None:
    """Fill in `trainer.precision` when the config leaves it out; the CLI calls this before building the Trainer."""
    if trainer.precision is None and isinstance(trainer.accelerator, str):
        if trains_on_a_gpu(trainer.accelerator) and forks(trainer.strategy):
            # Asking the GPU starts CUDA in this process, and a process forked from it cannot use CUDA then.
            raise ConfigError(
                "trainer.precision: set it (bf16-mixed or 32-true) with a strategy that forks its processes (ddp_fork,"
                " ddp_notebook, start_method fork): finding this GPU's default would start CUDA before they fork"
            )
        trainer.precision = default_precision(trainer.accelerator)


def forks(strategy: str | Namespace | None) -> bool:
    """Whether Lightning starts the strategy's processes by forking this one (ddp_fork, ddp_notebook, ...)."""
    if isinstance(strategy, str):
        registered = dict.get(StrategyRegistry, strategy, {})  # the registry's own get() builds the strategy
        return registered.get("init_params", {}).get("start_method") == "fork"
    init_args = getattr(strategy, "init_args", None)
    return getattr(init_args, "start_method", None) == "fork"


def has_tf32(device: torch.device) -> bool:
    """TF32 tensor cores came with compute capability 8.0 (Ampere)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


class Float32MatmulPrecision(Callback):
    """`torch.set_float32_matmul_precision(precision)` in every process that trains on a GPU with TF32.

    "high" lets float32 matrix multiplications use TF32 (10 mantissa bits instead of 23): several
    times faster, and accurate enough for training. Elsewhere this callback changes nothing.
    """

    def __init__(self, precision: str = "high") -> None:
        if precision not in ("highest", "high", "medium"):
            raise ValueError(f"precision must be 'highest', 'high' or 'medium', got {precision!r}")
        self.precision = precision
        if precision != "highest":
            # Lightning advises setting this precision when it sets up the GPU, before any callback runs.
            leave_out_lightning_lines(MATMUL_ADVICE)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if has_tf32(trainer.strategy.root_device):
            torch.set_float32_matmul_precision(self.precision)


class SkipEmptyHooks(Callback):
    """Lightning skips the per-step hooks that callbacks leave as `Callback`'s own, which do nothing.

    At every step Lightning calls six hooks of every callback, each inside its profiler's context, whether
    the callback defines the hook or not: 1-2 µs a call in a tight loop, about 0.25 ms a step for the
    default callbacks right after a backward pass (bench/README.md in the template repository). A hook set
    to None on the callback is skipped: Lightning calls only what is callable (`_call_callback_hooks` in
    lightning/pytorch/trainer/call.py; the kit's tests/test_speed.py checks that it still does so).
    """

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Every callback is in the list by now, the model's own (`configure_callbacks`) too.
        for callback in trainer.callbacks:
            for hook in STEP_HOOKS:
                if getattr(type(callback), hook, None) is getattr(Callback, hook):
                    setattr(callback, hook, None)
