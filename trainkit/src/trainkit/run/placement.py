"""Where each process of a job runs, and how a log line names a node by its processes."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """Where one process of the job runs."""

    node_rank: int
    global_rank: int
    host: str


def nodes_of(ranks: list[int], placement: list[Placement]) -> str:
    """The nodes these global ranks ran on, e.g. `node 1 (host test-1, global ranks 2, 3)`.

    A node is named with all its processes; when only some of them are among `ranks`, those are
    named too: a process that saw its node's peer die may answer before it dies itself.
    """
    by_node: dict[int, list[Placement]] = {}
    for process in placement:
        by_node.setdefault(process.node_rank, []).append(process)
    named = []
    for node, processes in sorted(by_node.items()):
        missing = [p.global_rank for p in processes if p.global_rank in ranks]
        if not missing:
            continue
        everyone = [p.global_rank for p in processes]
        ranks_word = "rank" if len(missing) == 1 else "ranks"
        which = "" if missing == everyone else f"; {ranks_word} {', '.join(map(str, missing))} did not answer"
        named.append(f"node {node} (host {processes[0].host}, global ranks {', '.join(map(str, everyone))}{which})")
    return " and ".join(named)
