"""NCCL's watchdog and flight recorder, set in every process before torch loads; a value set before wins.

- TORCH_NCCL_ASYNC_ERROR_HANDLING=3 (torch's default, named so that it is seen): a collective that
  failed or outlasted `cluster.timeout` ends the process with SIGABRT, which run/supervisor.py turns
  into exit 75, a retry. torchrun sets 1 in its workers, which ends the process the same way; a
  site's 0 would leave such a job hanging until the platform kills it.
- TORCH_FR_BUFFER_SIZE and TORCH_NCCL_DUMP_ON_TIMEOUT: the flight recorder keeps each
  process's last collectives and writes them out when the watchdog fires (to
  TORCH_FR_DUMP_TEMP_FILE<rank>, /tmp/nccl_trace_rank_<rank> by default): which rank
  stopped answering, and in which collective.
"""

import os

DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    "TORCH_FR_BUFFER_SIZE": "2000",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
}


def set_nccl_defaults() -> None:
    for name, value in DEFAULTS.items():
        os.environ.setdefault(name, value)
