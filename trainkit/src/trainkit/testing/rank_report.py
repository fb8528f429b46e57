"""A test-only callback: each process writes what it saw of the job, for the multi-process tests."""

import hashlib
import json
import os
from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor
from torch.distributed.tensor import DTensor

from trainkit.run.nccl import DEFAULTS as NCCL_DEFAULTS


class ReportRank(Callback):
    """At the end of `fit`, write `rank<global rank>.json` with the ranks and a digest of the weights."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        digest = hashlib.sha256()
        for name, tensor in sorted(pl_module.state_dict().items()):
            if isinstance(tensor, DTensor):  # sharded: every process gathers the whole tensor
                tensor = tensor.full_tensor()
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
        report = {
            # What this process holds of the weights, against their whole size: less when they are sharded.
            "parameters_held": sum(_held(parameter).numel() for parameter in pl_module.parameters()),
            "parameters": sum(parameter.numel() for parameter in pl_module.parameters()),
            "global_rank": trainer.global_rank,
            "node_rank": trainer.node_rank,
            "local_rank": trainer.local_rank,
            "world_size": trainer.world_size,
            "global_step": trainer.global_step,
            "weights": digest.hexdigest(),
            # What NCCL's watchdog and flight recorder would run with here (run/nccl.py).
            "nccl_settings": {name: os.environ.get(name) for name in NCCL_DEFAULTS},
        }
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


def _held(parameter: Tensor) -> Tensor:
    return parameter.to_local() if isinstance(parameter, DTensor) else parameter
