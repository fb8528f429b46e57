"""One checkpoint store location, one job: `fit` holds `<checkpoint_store.url>/run.lock` while it trains.

The run directory's lock (run/lock.py) cannot see a second job on another machine with a disk of
its own, which would write the same checkpoints in the store. This lock is an object in the store,
created only if absent, and follows the same rules: a second job is refused with one line naming
the first, and a lock left by a killed job is taken over when its process has ended on this
machine, when it is the same job restarted, or after 5 minutes without a heartbeat (the holder
rewrites it every 30 s with the time; clocks of different machines must roughly agree).
"""

import atexit
import contextlib
import json
import threading
import time
from typing import Any

from lightning.pytorch.utilities import rank_zero_info

from trainkit.run.errors import ConfigError
from trainkit.run.lock import (
    HEARTBEAT_SECONDS,
    LOCK_NAME,
    describe,
    first_process_of_the_job,
    this_process,
    why_abandoned,
)
from trainkit.store.object_store import ObjectStore, StoreConflict, StoreError


def lock_store(store: ObjectStore) -> None:
    """In the job's first process: hold the store's lock until this process ends, or refuse to run."""
    if not first_process_of_the_job():
        return
    mine = {**this_process(), "beat": time.time()}
    while True:
        try:
            version = store.write(LOCK_NAME, json.dumps(mine).encode(), replacing=None)
            break
        except StoreConflict:
            found = store.read_json(LOCK_NAME)
            if found is None:
                continue  # released meanwhile
            holder = found[0]
            silent = time.time() - float(holder.get("beat", 0))
            reason = why_abandoned(holder, silent)
            if reason is None:
                raise ConfigError(
                    f"checkpoint store {store.url} is in use by another job: {describe(holder, silent)}"
                    f" ({store.where(LOCK_NAME)}); stop it, or give this run another checkpoint_store.url"
                ) from None
            rank_zero_info(f"{store.where(LOCK_NAME)}: taking over the lock of {describe(holder, silent)}: {reason}")
            store.delete(LOCK_NAME)  # of two jobs taking over at once, only one creates it again
    atexit.register(_release, store, mine)
    threading.Thread(target=_keep_alive, args=(store, mine, version), name="store-lock", daemon=True).start()


def _keep_alive(store: ObjectStore, mine: dict[str, Any], version: str) -> None:
    while True:
        time.sleep(HEARTBEAT_SECONDS)
        mine["beat"] = time.time()
        try:
            version = store.write(LOCK_NAME, json.dumps(mine).encode(), replacing=version)
        except StoreConflict:
            return  # taken over: this job's next pointer update fails and ends it (checkpoints/stored.py)
        except StoreError:
            continue  # the store away for a moment: the next beat tries again


def _release(store: ObjectStore, mine: dict[str, Any]) -> None:
    if this_process()["pid"] != mine["pid"]:
        return  # a forked process (a data loader worker) that inherited this handler
    with contextlib.suppress(StoreError, ValueError):
        found = store.read_json(LOCK_NAME)
        if found is not None and all(found[0].get(key) == mine[key] for key in ("machine", "pid", "process_start")):
            store.delete(LOCK_NAME)
