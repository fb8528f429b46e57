"""One run directory, one job: `fit` holds `<run directory>/run.lock` while it trains.

Two jobs training in one directory would write the same checkpoints/ and log to the same wandb run,
the last writer winning. The job's first process (the one that becomes global rank 0) creates the
lock before anything is built, and a second job is refused with one line naming the first. `test`,
`validate` and `predict` take no lock: they may run beside a training (to try its best checkpoint).

A lock outlives a job that was killed (SIGKILL, a node that died). The next job takes it over,
saying so in one line, when
- it was written on this machine by a process that has ended (its process id is free, or now
  belongs to a process started later);
- it is this job's own: the platform restarted the job (a Slurm requeue keeps SLURM_JOB_ID,
  torchrun its run id, SING and POD the job's name), on another node too;
- it was written on another machine and shows no sign of life: its holder touches the file every
  30 s, and a lock untouched for 5 minutes is abandoned.
"""

import atexit
import contextlib
import json
import os
import socket
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_info, rank_zero_only

from trainkit.run.errors import ConfigError

LOCK_NAME = "run.lock"
HEARTBEAT_SECONDS = 30
ABANDONED_AFTER_SECONDS = 300


def lock_run_dir(run_dir: str | os.PathLike) -> None:
    """In the job's first process: hold `run_dir/run.lock` until this process ends, or refuse to run."""
    if not first_process_of_the_job():
        return
    path = Path(run_dir, LOCK_NAME)
    mine = this_process()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        while not _create(path, mine):
            found = _read(path)
            if found is None:
                continue  # released meanwhile
            holder, silent = found
            reason = why_abandoned(holder, silent)
            if reason is None:
                raise ConfigError(
                    f"run directory {run_dir} is in use by another job: {describe(holder, silent)} ({path});"
                    " stop it, or give this run another --trainer.default_root_dir"
                )
            rank_zero_info(f"{path}: taking over the lock of {describe(holder, silent)}: {reason}")
            path.unlink(missing_ok=True)
    except OSError as error:
        raise ConfigError(f"cannot lock run directory {run_dir}: {error.strerror} ({path})") from None
    atexit.register(_release, path, mine)
    threading.Thread(target=_keep_alive, args=(path,), name="run-lock", daemon=True).start()


def first_process_of_the_job() -> bool:
    """Whether this process becomes global rank 0, known before the processes of a node are started.

    Lightning reads the rank at import from RANK, LOCAL_RANK or SLURM_PROCID (torchrun, Slurm, the
    processes its own launcher starts); on SING and POD the command line sets it from the node-level
    environment (cli.py). A manual launch's other nodes differ only in NODE_RANK.
    """
    return rank_zero_only.rank == 0 and os.environ.get("NODE_RANK", "0") == "0"


def this_process() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": datetime.now().strftime("%Y-%m-%d %H:%M:%S"),
        "job": job_identity(),
        "machine": machine(),
        "process_start": process_start(os.getpid()),
    }


def job_identity() -> str | None:
    """What the platform keeps when it restarts this job and no other job shares; None where it gives none."""
    identities = {
        "SLURM_JOB_ID": os.environ.get("SLURM_JOB_ID"),
        "TORCHELASTIC_RUN_ID": _torchrun_run_id(),
        "SING_JOB_NAME": os.environ.get("SING_JOB_NAME"),
        # In a pod only (POD_WORLD_SIZE, pod.py): CI systems set a JOB_NAME of their own.
        "JOB_NAME": os.environ.get("JOB_NAME") if "POD_WORLD_SIZE" in os.environ else None,
    }
    return next((f"{name}={value}" for name, value in identities.items() if value), None)


def _torchrun_run_id() -> str | None:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return None if run_id == "none" else run_id  # "none" unless torchrun was given --rdzv-id or --standalone


def machine() -> str:
    """Processes that share this value see the same process ids: one boot of one machine, one PID namespace.

    Host names cannot tell: containers sharing the host's name have process ids of their own.
    """
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot} {os.readlink('/proc/self/ns/pid')}"
    except OSError:  # no /proc (macOS)
        return socket.gethostname()


def process_start(pid: int) -> str | None:
    """When process `pid` started, in clock ticks since boot (Linux); None where that cannot be read."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return None


def why_abandoned(holder: dict[str, Any], silent: float) -> str | None:
    """Why the job that wrote this lock (untouched for `silent` seconds) no longer holds it; None while it may."""
    if not isinstance(holder.get("pid"), int):
        return "the lock cannot be read"
    if holder.get("machine") == machine():
        return None if _running(holder["pid"], holder.get("process_start")) else f"process {holder['pid']} has ended"
    if holder.get("job") is not None and holder["job"] == job_identity():
        return f"it is this job's own ({holder['job']}), from before a restart"
    if silent > ABANDONED_AFTER_SECONDS:
        return f"no sign of life for {silent / 60:.0f} min"
    return None


def describe(holder: dict[str, Any], silent: float) -> str:
    if not isinstance(holder.get("pid"), int):
        return "an unknown job"
    job = f" ({holder['job']})" if holder.get("job") else ""
    text = f"host {holder.get('host')}, process {holder['pid']}{job}, started {holder.get('started')}"
    if holder.get("machine") != machine():  # its process cannot be checked from here: say when it last showed life
        text += f", alive {silent:.0f} s ago"
    return text


def _running(pid: int, started: str | None) -> bool:
    """Whether process `pid` of this machine is still the one that started at `started`."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process
    now = process_start(pid)
    return started is None or now is None or now == started


def _create(path: Path, record: dict[str, Any]) -> bool:
    """Create the lock with `record` in it; False if it exists. O_EXCL: of two jobs creating it, one succeeds."""
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except FileExistsError:
        return False
    try:
        with os.fdopen(descriptor, "w") as file:
            json.dump(record, file)
    except OSError:  # a full disk: leave no empty lock behind
        path.unlink(missing_ok=True)
        raise
    return True


def _read(path: Path) -> tuple[dict[str, Any], float] | None:
    """The lock's record and the seconds since it was last touched; None once it is gone."""
    for _ in range(3):
        try:
            silent = time.time() - path.stat().st_mtime
            record = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except ValueError:
            record = None
        if isinstance(record, dict):
            return record, silent
        time.sleep(1)  # created a moment ago, its record not written yet: read it again
    return {}, silent  # no job wrote it whole


def _keep_alive(path: Path) -> None:
    while True:
        time.sleep(HEARTBEAT_SECONDS)
        with contextlib.suppress(OSError):  # a file system away for a moment: the next beat tries again
            os.utime(path)


def _release(path: Path, mine: dict[str, Any]) -> None:
    if os.getpid() != mine["pid"]:
        return  # a forked process (a data loader worker) that inherited this handler
    try:
        if json.loads(path.read_text()) == mine:
            path.unlink()
    except (OSError, ValueError):
        pass  # gone already, or taken over by another job
