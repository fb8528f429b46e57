"""Fast defaults for the GPU a run lands on. Each one can be switched off in the config.

- Mixed precision: when the config leaves `trainer.precision` out, a GPU that computes in
  bfloat16 natively (Ampere and newer) trains in `bf16-mixed`, anything else (the CPU too) in
  `32-true`. Set `trainer.precision` to choose yourself.
- TF32: the `Float32MatmulPrecision` callback in `configs/experiment.yaml` lets float32 matrix
  multiplications use TF32 tensor cores on GPUs that have them. Remove it to keep full float32.
"""

import torch
from jsonargparse import Namespace
from lightning.pytorch import Callback, LightningModule, Trainer

GPU_ACCELERATORS = ("auto", "gpu", "cuda")  # the `trainer.accelerator` values that train on a GPU when there is one


def default_precision(accelerator: str) -> str:
    """`bf16-mixed` where `accelerator` means a GPU with native bfloat16, else `32-true`."""
    on_gpu = accelerator in GPU_ACCELERATORS and torch.cuda.is_available()
    # Older GPUs emulate bfloat16, slower than float32: only native support counts.
    if on_gpu and torch.cuda.is_bf16_supported(including_emulation=False):
        return "bf16-mixed"
    return "32-true"


def use_fast_defaults(trainer: Namespace) -> None:
    """Fill in `trainer.precision` when the config leaves it out; the CLI calls this before building the Trainer."""
    if trainer.precision is None and isinstance(trainer.accelerator, str):
        trainer.precision = default_precision(trainer.accelerator)


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

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if has_tf32(trainer.strategy.root_device):
            torch.set_float32_matmul_precision(self.precision)
