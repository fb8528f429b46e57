"""Launchers that start every process themselves: torchrun and Slurm's srun. A process one of them started
belongs to its launch, whatever platform's variables it also sees (torchrun inside a SING container, srun in
a job script that exports RANK and WORLD_SIZE)."""

import warnings

from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
from lightning.fabric.utilities.warnings import PossibleUserWarning


def started_by_torchrun() -> bool:
    return TorchElasticEnvironment.detect()


def started_by_srun() -> bool:
    # Lightning's check also warns whenever srun is installed but did not start this process: on a
    # machine with Slurm installed, every other launch (and every refused one) would print it first.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PossibleUserWarning)
        return SLURMEnvironment.detect()


def started_by_a_launcher() -> bool:
    return started_by_torchrun() or started_by_srun()
