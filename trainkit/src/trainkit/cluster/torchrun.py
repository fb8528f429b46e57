"""torchrun, ending with the training's exit status (trainkit/run/exit_codes.py) instead of 1.

torchrun exits 1 whenever a worker fails, whatever the worker's status, and 1 after a SIGTERM too:
a scheduler could not tell a preemption from a configuration error. This runs torchrun itself, with
the same options, and exits with

- 128 + the signal when torchrun was stopped by one: 143 for SIGTERM, 130 for Ctrl-C;
- otherwise the status of the worker that failed first in cause: when one worker fails, torchrun
  stops the others with SIGTERM (143) and peers on other nodes lose it (75), so those two count
  only when no worker says anything else;
- 75 when the nodes did not all join torchrun's rendezvous in time, or when this node cannot reach
  the rendezvous store: the first node's torchrun hosts it, so that node died or was stopped.

With --swarm it exits 0 for a configuration error (2) and Ctrl-C (130): Swarm restarts a task after
any non-zero status (restart_policy: on-failure), and a retry cannot fix either.

    python -m trainkit.cluster.torchrun [--swarm] <torchrun options> train.py fit ...
"""

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError
from torch.distributed.run import main as torchrun

from trainkit.run.exit_codes import CONFIG_ERROR, INTERRUPTED, LOST_NODE, PREEMPTED

# What a failure leaves in the other workers: torchrun stops them (SIGTERM), or they lose their peer.
ECHOES = (PREEMPTED, LOST_NODE)


def shell_status(exitcode: int) -> int:
    """A worker's status as a shell reports it: 128 + N for a worker killed by signal N."""
    return 128 - exitcode if exitcode < 0 else exitcode


def job_status(statuses: list[int]) -> int:
    """One status for the workers that failed: the cause rather than its echoes, a configuration error first."""
    causes = [status for status in statuses if status not in ECHOES]
    if causes:
        return CONFIG_ERROR if CONFIG_ERROR in causes else causes[0]
    return LOST_NODE if LOST_NODE in statuses else PREEMPTED


def rendezvous_endpoint(arguments: list[str]) -> str:
    """The value of torchrun's --rdzv-endpoint (or --rdzv_endpoint), "" when not given."""
    for index, argument in enumerate(arguments):
        name, equals, value = argument.partition("=")
        if name in ("--rdzv-endpoint", "--rdzv_endpoint"):
            return value if equals else (arguments[index + 1] if index + 1 < len(arguments) else "")
    return ""


def run_torchrun(arguments: list[str]) -> int:
    try:
        torchrun(arguments)
    except SignalException as stopped:
        return 128 + stopped.sigval
    except ChildFailedError as failed:
        statuses = {rank: shell_status(failure.exitcode) for rank, failure in sorted(failed.failures.items())}
        status = job_status(list(statuses.values()))
        print(f"torchrun: workers ended with {statuses} (global rank: status); exit status {status}", file=sys.stderr)
        return status
    except RendezvousTimeoutError:
        print("error: not every node joined torchrun's rendezvous in time", file=sys.stderr)
        return LOST_NODE
    except RendezvousConnectionError:
        # torchrun stopped this node's workers before it raised.
        endpoint = rendezvous_endpoint(arguments) or "the rendezvous endpoint"
        print(f"error: torchrun cannot reach its rendezvous store at {endpoint}: the node hosting it (its torchrun) "
              "probably died or was stopped: see its log", file=sys.stderr)  # fmt: skip
        return LOST_NODE
    return 0


def main() -> None:
    arguments = sys.argv[1:]
    swarm = arguments[:1] == ["--swarm"]
    status = run_torchrun(arguments[1:] if swarm else arguments)
    if swarm and status in (CONFIG_ERROR, INTERRUPTED):
        print(f"torchrun: exit status {status}, a retry cannot help: exiting 0 so that Swarm does not restart the task",
              file=sys.stderr)  # fmt: skip
        status = 0
    sys.exit(status)


if __name__ == "__main__":
    main()
