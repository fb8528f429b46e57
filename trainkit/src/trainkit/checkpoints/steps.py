"""Whether a training batch ended with an optimizer step: only then does a checkpoint hold all that was trained.

With gradient accumulation (`trainer.accumulate_grad_batches`, or a model that steps its optimizer by hand every
few batches) a batch may only add to gradients that a later step applies. Checkpoints keep no gradients, so one
saved after such a batch would lose them, and a run resumed from it would train other weights.
"""

from lightning.pytorch import Trainer


class OptimizerSteps:
    """Tells, batch by batch, whether the optimizer stepped (`trainer.global_step` moved)."""

    def __init__(self) -> None:
        self._seen = 0

    def start(self, trainer: Trainer) -> None:
        self._seen = trainer.global_step

    def stepped(self, trainer: Trainer) -> bool:
        """Whether the optimizer stepped since the last call: in this batch, when called after every batch."""
        stepped, self._seen = trainer.global_step != self._seen, trainer.global_step
        return stepped
