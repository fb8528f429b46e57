"""A real Slurm cluster on this machine, for tests: munged, slurmctld and one slurmd per node.

Everything lives in one temporary folder: the munge key and socket, slurm.conf, state, spool,
logs. Ports are picked free at start, so the cluster shares the machine with anything else,
including another test session's cluster. Needs root (slurmd runs jobs as their user and the
nodes need a private /etc/hosts) and Debian's `slurm-wlm` and `munge`.

Several nodes run on one host with Slurm's multiple-slurmd support: node names n1, n2, ...
all reach 127.0.0.1 on their own port. Each slurmd runs in its own mount namespace with an
/etc/hosts that maps the node names to 127.0.0.1, because jobs (Lightning among them) connect
to the first node by its name; the machine's /etc/hosts is never touched.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Self

from .host import apt_install

PACKAGES = ("slurm-wlm", "munge")
DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "unshare")
EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def missing_programs() -> list[str]:
    return [
        name for name in DAEMONS if shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None
    ]


def install_packages() -> None:
    apt_install(PACKAGES)


def free_port() -> int:
    return free_port_range(1)


def free_port_range(count: int, tries: int = 100) -> int:
    """The first of `count` consecutive ports that were free a moment ago (slurm.conf gives the nodes a range).

    Drawn below the ports Linux gives outgoing connections: a port from there (what binding port 0
    returns) may be taken by any connection opened before the daemon or job listens on it.
    """
    first_ephemeral = int(EPHEMERAL_PORTS.read_text().split()[0])
    for first in random.SystemRandom().sample(range(10000, first_ephemeral - count), tries):
        sockets = [socket.socket() for _ in range(count)]
        try:
            for port, sock in zip(range(first, first + count), sockets, strict=True):
                sock.bind(("", port))
            return first
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports among {tries} tries below {first_ephemeral}")


class SlurmCluster:
    """`with SlurmCluster(folder, nodes=2) as cluster:` starts the daemons and stops them on exit."""

    def __init__(self, root: Path, nodes: int = 1, cpus_per_node: int | None = None) -> None:
        self.root = Path(root)
        self.nodes = [f"n{index}" for index in range(1, nodes + 1)]
        self.cpus_per_node = cpus_per_node or os.cpu_count() or 1
        self.conf = self.root / "slurm.conf"
        self._daemons: list[tuple[str, subprocess.Popen]] = []

    # ---- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self, timeout: float = 30) -> None:
        for folder in ("munge", "state", "spool", "logs"):
            (self.root / folder).mkdir(parents=True, exist_ok=True)
        (self.root / "munge").chmod(0o700)
        self._start_munge()
        controller_port = free_port()
        first_node_port = free_port_range(len(self.nodes))
        self._write_conf(controller_port, first_node_port)
        hosts = self.root / "hosts"
        hosts.write_text(Path("/etc/hosts").read_text() + f"\n127.0.0.1 {' '.join(self.nodes)}\n")
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        for node in self.nodes:
            # A private mount namespace per slurmd, so the node names resolve inside jobs only.
            command = 'mount --bind "$0" /etc/hosts && exec slurmd -D -N "$1" -f "$2"'
            self._spawn(
                f"slurmd-{node}",
                ["unshare", "-m", "--propagation", "private", "sh", "-c", command, str(hosts), node, str(self.conf)],
            )
        self._wait_until_idle(timeout)

    def stop(self) -> None:
        """Cancel jobs, then stop every daemon this object started (and what they started)."""
        if self._daemons and self.conf.exists():
            subprocess.run(
                ["scancel", "--full", "--quiet", "--user", "root"], env=self.env(), capture_output=True, check=False
            )
        for _, process in reversed(self._daemons):
            _signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for _, process in reversed(self._daemons):
            while not _has_exited(process) and time.monotonic() < deadline:
                time.sleep(0.05)
            # Job steps may outlive their slurmd: end the whole group. Until it is reaped below, the
            # exited daemon keeps its process id, so the group id cannot name anyone else's processes.
            _signal_group(process, signal.SIGKILL)
            process.wait()
        self._daemons.clear()
        # slurmstepd (one per job step) leaves slurmd's group; after a hung or cancelled job it and
        # the job's processes can outlive the daemons. Ours hold this cluster's files open.
        for pid in _with_descendants(self._step_daemons()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _step_daemons(self) -> list[int]:
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                if not (proc / "comm").read_text().startswith("slurmstepd"):
                    continue
                if any(os.readlink(fd).startswith(f"{self.root}/") for fd in (proc / "fd").iterdir()):
                    found.append(int(proc.name))
            except OSError:  # ended meanwhile, or not ours to read
                continue
        return found

    # ---- jobs ------------------------------------------------------------------------------
    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """An environment whose Slurm commands talk to this cluster."""
        return {**(os.environ if base is None else base), "SLURM_CONF": str(self.conf)}

    def sbatch(self, args: list[str], env: dict[str, str], cwd: Path) -> str:
        result = subprocess.run(
            ["sbatch", "--parsable", *args],
            env=self.env(env),
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} failed: {result.stderr}")
        return result.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, NodeList, StdOut, ...)."""
        result = subprocess.run(
            ["scontrol", "show", "job", "--oneliner", job_id],
            env=self.env(),
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"scontrol show job {job_id}: {result.stderr}")
        return dict(re.findall(r"(\w+)=(\S*)", result.stdout))

    def wait(self, job_id: str, timeout: float = 180) -> dict[str, str]:
        """Poll the job until it ends (faster than `sbatch --wait`, which polls every 10 s)."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if job.get("JobState") in FINAL_STATES:
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job.get('JobState')} after {timeout:g} s:\n{self.logs()}")
            self._check_daemons()
            time.sleep(0.5)

    def cancel(self, job_id: str, timeout: float = 120) -> dict[str, str]:
        """Cancel the job and wait until it has ended. A job being requeued refuses a cancel until it is
        pending again, and would then start over: ask again until Slurm says it ended."""
        deadline = time.monotonic() + timeout
        while True:
            subprocess.run(["scancel", job_id], env=self.env(), capture_output=True, check=False)
            job = self.job(job_id)
            if job.get("JobState") in FINAL_STATES:
                return job
            if time.monotonic() > deadline:
                state = job.get("JobState")
                raise TimeoutError(f"job {job_id} still {state} {timeout:g} s after scancel:\n{self.logs()}")
            time.sleep(1)

    def signal(self, job_id: str, name: str, batch_script: bool = False) -> None:
        """Signal the job's tasks, or only its batch script, as Slurm does for `--signal=[B:]SIG@time`."""
        command = ["scancel", f"--signal={name}", *(["--batch"] if batch_script else []), job_id]
        subprocess.run(command, env=self.env(), check=True, capture_output=True)

    def release(self, job_id: str) -> None:
        """Let a requeued job start now (Slurm makes it wait before it becomes eligible again)."""
        subprocess.run(
            ["scontrol", "update", f"jobid={job_id}", "StartTime=now"], env=self.env(), check=True, capture_output=True
        )

    def logs(self) -> str:
        """The daemons' logs, for a failure message."""
        parts = []
        for path in sorted((self.root / "logs").glob("*.log")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)

    # ---- internals -------------------------------------------------------------------------
    def _start_munge(self) -> None:
        munge = self.root / "munge"
        key = munge / "munge.key"
        subprocess.run(["mungekey", "--create", "--keyfile", str(key)], check=True, capture_output=True)
        self.munge_socket = munge / "munge.socket"
        self._spawn(
            "munged",
            [
                "munged", "--foreground", "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
                f"--pid-file={munge / 'munged.pid'}", f"--seed-file={munge / 'munged.seed'}",
                f"--log-file={self.root / 'logs' / 'munged.log'}",
            ],
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while not self.munge_socket.exists():
            self._check_daemons()
            if time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start:\n{self.logs()}")
            time.sleep(0.05)

    def _write_conf(self, controller_port: int, first_node_port: int) -> None:
        count, root = len(self.nodes), self.root
        node_names = self.nodes[0] if count == 1 else f"n[1-{count}]"
        node_ports = str(first_node_port) if count == 1 else f"[{first_node_port}-{first_node_port + count - 1}]"
        # Every node is this host, reached on 127.0.0.1 at its own port.
        node_line = (
            f"NodeHostname={socket.gethostname()} NodeAddr=127.0.0.1 Port={node_ports} CPUs={self.cpus_per_node}"
        )
        self.conf.write_text(
            f"""\
ClusterName=test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={controller_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={root / "state"}
SlurmdSpoolDir={root / "spool"}/%n
SlurmctldPidFile={root / "slurmctld.pid"}
SlurmdPidFile={root / "spool"}/slurmd-%n.pid
SlurmctldLogFile={root / "logs" / "slurmctld.log"}
SlurmdLogFile={root / "logs"}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
# Trust the CPU counts below, whatever this machine has.
SlurmdParameters=config_overrides
SchedulerParameters=batch_sched_delay=0,sched_interval=1
NodeName={node_names} {node_line} State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        )

    def _spawn(self, name: str, command: list[str]) -> None:
        # Own session: stop() ends the daemon and everything it started, and nothing else.
        with (self.root / "logs" / f"{name}.stdout").open("w") as log:  # the daemon writes its own copy
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._daemons.append((name, process))

    def _check_daemons(self) -> None:
        for name, process in self._daemons:
            if process.poll() is not None:
                output = (self.root / "logs" / f"{name}.stdout").read_text(errors="replace")
                raise RuntimeError(f"{name} exited with {process.returncode}:\n{output}\n{self.logs()}")

    def _wait_until_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self._check_daemons()
            result = subprocess.run(
                ["sinfo", "--noheader", "--Node", "--format=%N %t"],
                env=self.env(),
                capture_output=True,
                text=True,
                check=False,
            )
            states = dict(line.split() for line in result.stdout.splitlines() if line.strip())
            if result.returncode == 0 and all(states.get(node) == "idle" for node in self.nodes):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"nodes not idle after {timeout:g} s: {states or result.stderr}\n{self.logs()}")
            time.sleep(0.2)


def _has_exited(process: subprocess.Popen) -> bool:
    """Whether the process has ended, without reaping it (its id stays ours until `wait`)."""
    if process.returncode is not None:
        return True
    return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    if process.returncode is not None:  # reaped: its group id may belong to someone else by now
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signum)


def _with_descendants(pids: list[int]) -> list[int]:
    """`pids` and every process started under them, parents first."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                # The parent id is the second field after the command name, which may hold spaces.
                parent = int((proc / "stat").read_text().rpartition(")")[2].split()[1])
                children.setdefault(parent, []).append(int(proc.name))
    found, queue = [], list(pids)
    while queue:
        pid = queue.pop(0)
        found.append(pid)
        queue.extend(children.get(pid, []))
    return found
