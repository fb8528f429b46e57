"""Every strategy of several processes waits `cluster.timeout` for a lost peer, not torch's 30 minutes.

With several processes, strategy "auto" resolves to Lightning's registered "ddp" strategy. The command line
registers it, and every name that differs from it only in `find_unused_parameters`, as the kit's
WatchedDDPStrategy (strategies/ddp.py) with the cluster's timeouts; Lightning's other strategies by name that
take a timeout (ddp_spawn, deepspeed, fsdp) get `cluster.timeout`. A DDPStrategy or FSDPStrategy configured by
its class, with arguments of its own, gets the same.
"""

from typing import Any

from jsonargparse import Namespace
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, StrategyRegistry

from trainkit.cluster.settings import ClusterSettings
from trainkit.run.config import class_of
from trainkit.strategies.ddp import WatchedDDPStrategy

TIMEOUTS = ("timeout", "join_timeout")  # what use_timeouts_for_ddp sets in a registered strategy's arguments


def use_timeouts_for_ddp(cluster: ClusterSettings) -> None:
    """Register Lightning's strategy names anew with the cluster's timeouts: "ddp" and the names that differ from it
    only in find_unused_parameters (as Lightning advises for GANs) as WatchedDDPStrategy, the others that take a
    timeout as they are, with `cluster.timeout`."""
    for name in StrategyRegistry.available_strategies():
        registered = dict.get(StrategyRegistry, name)  # the registry's own get() builds the strategy
        params = {key: value for key, value in registered["init_params"].items() if key not in TIMEOUTS}
        if issubclass(registered["strategy"], DDPStrategy) and params.get("start_method") == "popen":
            StrategyRegistry.register(
                name,
                WatchedDDPStrategy,
                description=f"DDP {params} with cluster.timeout and cluster.join_timeout",
                override=True,
                **params,
                timeout=cluster.timeout,
                join_timeout=cluster.join_timeout,
            )
        elif issubclass(registered["strategy"], (DDPStrategy, FSDPStrategy)):  # ddp_spawn, deepspeed, fsdp: the timeout
            StrategyRegistry.register(
                name,
                registered["strategy"],
                description=f"Lightning's {name}, with cluster.timeout",
                override=True,
                **params,
                timeout=cluster.timeout,
            )


def watch_ddp_configured_by_class(strategy: Any, cluster: Namespace) -> None:
    """Lightning's DDPStrategy configured by its class (for `find_unused_parameters`, `static_graph`, ...) as the
    kit's WatchedDDPStrategy with the same arguments and cluster's timeouts, as "ddp" by name is: Lightning's own
    waits 30 minutes for a lost node and knows nothing of cluster.join_timeout. Lightning's FSDPStrategy gets
    cluster.timeout."""
    if not isinstance(strategy, Namespace) or "class_path" not in strategy:
        return  # a name ("ddp", "auto"), which use_timeouts_for_ddp covers
    kind = class_of(strategy.class_path)
    if kind is DDPStrategy:
        strategy.class_path = f"{WatchedDDPStrategy.__module__}.{WatchedDDPStrategy.__name__}"
        strategy.init_args.timeout, strategy.init_args.join_timeout = cluster.timeout, cluster.join_timeout
    elif kind is FSDPStrategy:
        strategy.init_args.timeout = cluster.timeout
