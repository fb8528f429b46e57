"""A real Docker engine and a one-machine Swarm, for tests: dockerd from Debian's docker.io.

The daemon runs with its own data root, exec root, socket and pid file, so it shares the machine
with any other Docker engine and stops without touching one. Its data root is kept between test
sessions (a cache, like pip's): an image loaded once is not loaded again. `stop()` leaves the
Swarm and ends the daemon and what it started; stacks are removed by the test that deployed them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Self

from .containers import PODMAN, ensure_programs

PACKAGES = ("docker.io",)
DEBIAN_CLI = "/usr/bin/docker"  # docker.io's client: 20.10 on Debian 12
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lightning-template-tests" / "dockerd"


class DockerSwarm:
    """`with DockerSwarm(folder) as swarm:` starts dockerd and a Swarm; `swarm.docker(...)` talks to it."""

    def __init__(self, root: Path, cli: str = DEBIAN_CLI) -> None:
        self.root = Path(root)
        self.socket = self.root / "docker.sock"
        self.cli = cli
        self._daemon: subprocess.Popen | None = None
        self._lock = None

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self, timeout: float = 60) -> None:
        ensure_programs(("dockerd", "containerd"), PACKAGES)
        CACHE.mkdir(parents=True, exist_ok=True)
        # One daemon at a time on the cached data root: a second test session waits here.
        self._lock = (CACHE / "lock").open("w")
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        self.root.mkdir(parents=True, exist_ok=True)
        with (self.root / "dockerd.log").open("w") as log:  # the daemon writes its own copy
            self._daemon = subprocess.Popen(
                ["dockerd", "--data-root", str(CACHE / "data"), "--exec-root", str(self.root / "exec"),
                 "-H", f"unix://{self.socket}", "--pidfile", str(self.root / "docker.pid")],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while self.docker("info", check=False).returncode != 0:
            if self._daemon.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dockerd did not start:\n{self.log()}")
            time.sleep(0.3)
        if self.docker("info", "--format", "{{.Swarm.LocalNodeState}}").stdout.strip() == "active":
            self.docker("swarm", "leave", "--force")  # left over from a session that was killed
        self.docker("swarm", "init", "--advertise-addr", "127.0.0.1", "--listen-addr", "127.0.0.1:2377")

    def stop(self) -> None:
        if self._daemon is not None and self._daemon.poll() is None:
            self.docker("swarm", "leave", "--force", check=False)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._daemon.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._daemon.wait(timeout=30)
            # containerd and the container shims are in the daemon's process group.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._daemon.pid, signal.SIGKILL)
            self._daemon.wait()
        if self._lock is not None:
            self._lock.close()  # releases the lock
            self._lock = None

    def docker(self, *args: str, cli: str | None = None, timeout: float = 120, check: bool = True):
        result = subprocess.run(
            [cli or self.cli, "-H", f"unix://{self.socket}", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)} failed ({result.returncode}):\n{result.stderr[-4000:]}")
        return result

    def log(self) -> str:
        path = self.root / "dockerd.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def load_from_podman(self, image: str) -> None:
        """Copy a podman image into this engine (`podman save | docker load`), unless it holds it already."""
        podman_id = subprocess.run(
            [*PODMAN, "image", "inspect", "--format", "{{.Id}}", image], capture_output=True, text=True, check=True
        ).stdout.strip()
        here = self.docker("image", "inspect", "--format", "{{.Id}}", image, check=False).stdout.strip()
        if here.removeprefix("sha256:") == podman_id:
            return
        save = subprocess.Popen([*PODMAN, "save", "--format", "docker-archive", image], stdout=subprocess.PIPE)
        load = subprocess.run(
            [self.cli, "-H", f"unix://{self.socket}", "load"], stdin=save.stdout, capture_output=True, text=True
        )
        save.stdout.close()
        if save.wait() != 0 or load.returncode != 0:
            raise RuntimeError(f"podman save | docker load failed: {load.stderr[-2000:]}")
        self.docker("image", "prune", "--force")  # images this engine held under the same name before
