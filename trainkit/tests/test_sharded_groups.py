"""The sharded strategy's own process group, for background saves, waits as long as the job's: cluster.timeout."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy

from trainkit.checkpoints.saving import CheckpointSavingSettings
from trainkit.cluster.settings import ClusterSettings
from trainkit.strategies.sharded import ShardedStrategy

from .helpers import free_port


@pytest.fixture
def one_process_job():
    """A job of this one process over gloo, as Lightning's set-up leaves it."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_background_saves_gloo_group_takes_cluster_timeout(one_process_job, monkeypatch):
    monkeypatch.setattr(ModelParallelStrategy, "setup_environment", lambda strategy: None)  # the job is formed
    strategy = ShardedStrategy()
    strategy.parallel_devices = [torch.device("cpu")]
    strategy.use(ClusterSettings(timeout=timedelta(seconds=42)), CheckpointSavingSettings(asynchronous=True))
    strategy.setup_environment()
    gloo = strategy._checkpoint_group._get_backend(torch.device("cpu"))
    assert gloo.options._timeout == timedelta(seconds=42)  # gloo's own default is 30 minutes
