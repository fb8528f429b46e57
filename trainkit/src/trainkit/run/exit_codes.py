"""How a run ends, as an exit status a scheduler can act on: retry, give up, or leave it to a person.

| status | meaning                                                                | scheduler                         |
|--------|------------------------------------------------------------------------|-----------------------------------|
| 0      | finished                                                               | done                              |
| 1      | anything else (a bug, out of memory, a data error mid-run)             | look at the log                   |
| 2      | configuration error: a setting, variable, file or path                 | never retry: it fails again       |
| 74     | a checkpoint could not be written or stored (full disk, failing store) | fix it first: a retry ends with 2 |
| 75     | a node was lost, or a collective timed out                             | retry: it resumes                 |
| 130    | stopped by Ctrl-C (SIGINT), after saving a checkpoint                  | a person stopped it: leave it     |
| 143    | preempted (SIGTERM), after saving a checkpoint                         | retry: it resumes                 |

The launch recipes in launch/ use these: the POD Job's podFailurePolicy, the sbatch requeue,
the Swarm restart policy.
"""

import signal

CONFIG_ERROR = 2
CANNOT_WRITE = 74  # EX_IOERR in BSD's sysexits.h: the disk or store refused a write; older checkpoints are intact
LOST_NODE = 75  # EX_TEMPFAIL in BSD's sysexits.h: a temporary failure, worth retrying
INTERRUPTED = 128 + signal.SIGINT  # 130, what shells report for Ctrl-C
PREEMPTED = 128 + signal.SIGTERM  # 143, what platforms expect from a terminated job
