"""A callback the GPU check adds to the template's real `fit` (`--trainer.callbacks+=...`): what the run trained with.

Each process writes its own record, `<out>.rank<global rank>.json`: the device, precision, float32
matmul precision (TF32), the process group's backend, whether the training loader pins memory,
where batches arrive, whether the network is compiled, images/s after a warm-up, and the last step;
process 0 also writes the weights at the end, `<out>.weights.pt`. With `rng_at_step` each process
records digests of its CPU and GPU random generators at the start of that step; with
`seed_per_rank` a fresh run reseeds each process's torch generators with the seed plus its rank;
with `sigterm_at_step` process 0 sends itself SIGTERM once that step is done, as a platform
preempting the job would.
"""

import hashlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer

WARMUP_STEPS = 10


def digest(state: torch.Tensor) -> str:
    return hashlib.sha256(state.cpu().numpy().tobytes()).hexdigest()[:16]


def record_path(out: Path, rank: int) -> Path:
    return out.with_name(f"{out.name}.rank{rank}.json")


class GpuProbe(Callback):
    def __init__(self, out: str, rng_at_step: int = -1, sigterm_at_step: int = -1, seed_per_rank: bool = False) -> None:
        self.out = Path(out)
        self.rng_at_step = rng_at_step
        self.sigterm_at_step = sigterm_at_step
        self.seed_per_rank = seed_per_rank
        self.record: dict[str, Any] = {}
        self.clock_start: tuple[float, int] | None = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.seed_per_rank and trainer.global_step == 0:
            # The default config seeds every process alike, so their generators stay equal and a resume that
            # gave every process process 0's state would pass unseen; distinct streams (dropout seeded per
            # rank) tell them apart. A resumed run (global_step > 0) keeps what it restored.
            torch.manual_seed(torch.initial_seed() + trainer.global_rank)
        loader = trainer.train_dataloader
        self.record.update(
            device=str(trainer.strategy.root_device),
            precision=str(trainer.precision),
            float32_matmul_precision=torch.get_float32_matmul_precision(),
            backend=dist.get_backend() if dist.is_initialized() else None,
            pin_memory=bool(getattr(loader, "pin_memory", False)),
            num_workers=int(getattr(loader, "num_workers", 0)),
            compiled=any(getattr(module, "_compiled_call_impl", None) is not None for module in pl_module.modules()),
            world_size=trainer.world_size,
            global_rank=trainer.global_rank,
            first_step=trainer.global_step,
        )
        self._write(trainer)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if "batch_device" not in self.record:
            self.record.update(batch_device=str(batch[0].device), batch_size=len(batch[0]))
        if trainer.global_step == self.rng_at_step:
            on_gpu = pl_module.device.type == "cuda"
            self.record["rng_at_step"] = {
                "step": trainer.global_step,
                "cpu": digest(torch.get_rng_state()),
                "cuda": digest(torch.cuda.get_rng_state(pl_module.device)) if on_gpu else None,
            }
            self._write(trainer)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        steps_done = trainer.global_step - self.record["first_step"]
        if steps_done == WARMUP_STEPS:
            self._synchronize(pl_module)
            self.clock_start = (time.perf_counter(), trainer.global_step)
        # Process 0 alone, as a platform that signals a node's first process: the others stop by agreeing.
        if trainer.global_step == self.sigterm_at_step and trainer.is_global_zero:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._synchronize(pl_module)
        if self.clock_start is not None:
            started, step = self.clock_start
            images = (trainer.global_step - step) * self.record["batch_size"] * trainer.world_size
            self.record["images_per_s"] = images / (time.perf_counter() - started)
        self.record["last_step"] = trainer.global_step
        if trainer.strategy.root_device.type == "cuda":  # the module itself is back on the CPU by now
            self.record["max_memory_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
        self._write(trainer)
        if trainer.is_global_zero:
            weights = {name: tensor.detach().cpu() for name, tensor in pl_module.state_dict().items()}
            torch.save(weights, self.out.with_name(f"{self.out.name}.weights.pt"))

    @staticmethod
    def _synchronize(pl_module: LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def _write(self, trainer: Trainer) -> None:
        record_path(self.out, trainer.global_rank).write_text(json.dumps(self.record, indent=2))
