"""trainkit: what runs a Lightning project the same way on a laptop and on clusters.

The command line, cluster environments, checkpoints and preemption, signals, tracking, sweeps.
Nothing here imports a project's models or data modules: configs choose them by class_path.
"""

from trainkit.run.errors import ConfigError

__version__ = "0.1.0"
__all__ = ["ConfigError", "__version__"]
