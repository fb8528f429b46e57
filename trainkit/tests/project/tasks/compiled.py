"""The tests' tiny model, compiled as a researcher may write it: `torch.compile` of its network in configure_model."""

import torch
from torch._dynamo import OptimizedModule

from trainkit.testing.tiny import TinyClassifier


class CompiledClassifier(TinyClassifier):
    """TinyClassifier whose network is wrapped by torch.compile once the model is on its device."""

    def configure_model(self) -> None:
        if not isinstance(self.net, OptimizedModule):  # Lightning calls this hook again for a test after a fit
            self.net = torch.compile(self.net)
