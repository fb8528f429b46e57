"""The node count and processes per node: the platform's, checked against `trainer.num_nodes` and `trainer.devices`."""

from trainkit.cluster.launch_variables import ClusterConfigError
from trainkit.cluster.platforms import Platform


def devices_per_node(configured: int | str | list[int], platform: Platform) -> int | str | list[int]:
    """The processes the launcher started on this node when `trainer.devices` is auto; a different count is an error."""
    started = platform.processes_per_node
    if started is None:
        return configured
    if configured == "auto":
        return started
    requested = _device_count(configured)
    if requested is not None and requested != started:
        raise ClusterConfigError(
            f"trainer.devices={configured} but {platform.processes_per_node_variable}={started}: {platform.name}"
            f" started {started} processes on this node; leave trainer.devices at auto, the launcher sets it"
        )
    return configured


def _device_count(devices: int | str | list[int]) -> int | None:
    """How many devices `trainer.devices` asks for, when it says so plainly (a count or a list of indices)."""
    if isinstance(devices, list):
        return len(devices)
    text = str(devices).strip()
    return int(text) if text.isdigit() else None


def num_nodes(configured: int, platform: Platform) -> int:
    """The platform's node count; a different `trainer.num_nodes` (other than the default 1) is an error."""
    if platform.num_nodes is None:
        return configured
    if configured not in (1, platform.num_nodes):
        raise ClusterConfigError(
            f"trainer.num_nodes={configured} but {platform.num_nodes_variable}={platform.num_nodes} on"
            f" {platform.name}; leave trainer.num_nodes out, the platform sets it"
        )
    return platform.num_nodes
