"""Real containers for the template's tests: podman builds the generated image and runs it.

Needs root and Debian's podman (with runc, netavark and aardvark-dns for name resolution),
buildah and mmdebstrap; they are installed with apt-get when missing. No registry is reachable
from these machines, so the CUDA PyTorch base image is replaced by a CPU stand-in made from
Debian packages and PyPI: a minimal Debian with python3 (mmdebstrap, imported into podman),
and on it a venv on PATH with the pinned torch and torchvision (base_image/Dockerfile), the way
the PyTorch images carry them. Both are kept under tags that name what they hold, so a later
test session reuses them; the project's own image is built anew by every session.

podman here needs `--runtime runc` (crun refuses this machine's cgroup layout) and explicit
ulimits (the defaults cannot be set). pip inside a build trusts what this machine's pip trusts
when the machine's CA bundle is mounted at the same path.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from .host import apt_install

TESTS = Path(__file__).resolve().parent
REQUIREMENTS = TESTS.parent / "requirements-test.txt"
BASE_DOCKERFILE = TESTS / "base_image" / "Dockerfile"
# netavark, podman's network backend, runs iptables: without it every build and network fails.
PACKAGES = ("podman", "runc", "netavark", "aardvark-dns", "iptables", "buildah", "mmdebstrap")
PROGRAMS = ("podman", "runc", "iptables", "mmdebstrap")
IMAGES = "localhost/lightning-template-tests"
DEBIAN_IMAGE = f"{IMAGES}/debian:bookworm"
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
PODMAN = ["podman", "--runtime", "runc"]
LIMITS = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
# The user the generated Dockerfile trains as (its USER_ID build argument).
IMAGE_USER_ID = 1000


# ---- tools -----------------------------------------------------------------------------------


def ensure_programs(programs: tuple[str, ...], packages: tuple[str, ...]) -> None:
    missing = [name for name in programs if shutil.which(name) is None]
    if missing:
        apt_install(packages)
    missing = [name for name in programs if shutil.which(name) is None]
    assert not missing, f"still missing after installing {packages}: {missing}"


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)} failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result


def image_exists(tag: str) -> bool:
    return podman("image", "exists", tag, check=False).returncode == 0


def image_id(tag: str) -> str | None:
    result = podman("image", "inspect", "--format", "{{.Id}}", tag, check=False)
    return result.stdout.strip() if result.returncode == 0 else None


def rebuild(context: Path, tag: str, build_args: dict[str, str]) -> None:
    """Build `tag` again, and remove the image it named before if the build made a new one."""
    previous = image_id(tag)
    build(context, tag, build_args)
    if previous not in (None, image_id(tag)):
        podman("rmi", previous, check=False)  # still in use by a container: kept


def build(context: Path, tag: str, build_args: dict[str, str], dockerfile: Path | None = None) -> str:
    """`podman build` as a user builds an image, with this machine's CA bundle for pip; its output."""
    options = [f"--build-arg={name}={value}" for name, value in build_args.items()]
    if dockerfile is not None:
        options += ["--file", str(dockerfile)]
    return podman("build", *LIMITS, "--volume", f"{CA_BUNDLE}:{CA_BUNDLE}:ro", *options, "--tag", tag, str(context),
                  timeout=900).stdout  # fmt: skip


# ---- images ----------------------------------------------------------------------------------


def pinned(package: str) -> str:
    """The version requirements-test.txt pins `package` to."""
    found = re.search(rf"^{re.escape(package)}==(\S+)", REQUIREMENTS.read_text(), re.MULTILINE)
    assert found, f"{package} is not pinned in {REQUIREMENTS.name}"
    return found.group(1)


def debian_image() -> str:
    """A minimal Debian 12 with python3 and python3-venv, made with mmdebstrap (about 30 s once)."""
    if not image_exists(DEBIAN_IMAGE):
        with tempfile.TemporaryDirectory() as folder:
            rootfs = Path(folder, "rootfs.tar")
            subprocess.run(
                ["mmdebstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates", "bookworm",
                 str(rootfs)],
                capture_output=True, check=True, timeout=600,
            )  # fmt: skip
            podman("import", str(rootfs), DEBIAN_IMAGE, timeout=300)
    return DEBIAN_IMAGE


def torch_base_image() -> str:
    """The CPU stand-in for the CUDA PyTorch base image (about 3 minutes once), named by what it holds."""
    versions = {"TORCH_VERSION": pinned("torch"), "TORCHVISION_VERSION": pinned("torchvision")}
    recipe = hashlib.sha256(BASE_DOCKERFILE.read_bytes()).hexdigest()[:12]
    tag = f"{IMAGES}/torch-base:torch{versions['TORCH_VERSION']}-vision{versions['TORCHVISION_VERSION']}-{recipe}"
    if not image_exists(tag):
        build(BASE_DOCKERFILE.parent, tag, {"DEBIAN_IMAGE": debian_image(), **versions})
    return tag


def image_command(image: str) -> list[str]:
    """The image's own command (its CMD)."""
    return json.loads(podman("image", "inspect", "--format", "{{json .Config.Cmd}}", image).stdout)


def image_user(image: str) -> str:
    return podman("image", "inspect", "--format", "{{.Config.User}}", image).stdout.strip()


# ---- containers ------------------------------------------------------------------------------


class Containers:
    """Containers and networks started by one test; `close()` removes those and nothing else."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.containers: list[str] = []
        self.networks: list[str] = []

    def network(self, name: str) -> str:
        """A network whose DNS answers the containers' names and aliases."""
        full = f"{self.prefix}-{name}"
        podman("network", "create", full)
        self.networks.append(full)
        return full

    def run(self, name: str, image: str, command: list[str], *, network: str, hostname: str, aliases: list[str],
            env: dict[str, str], volumes: list[str]) -> str:  # fmt: skip
        """Start a container in the background; its name."""
        full = f"{self.prefix}-{name}"
        options = ["--detach", "--name", full, "--network", network, "--hostname", hostname, *LIMITS]
        options += [f"--network-alias={alias}" for alias in aliases]
        options += [f"--env={name}={value}" for name, value in env.items()]
        options += [f"--volume={volume}" for volume in volumes]
        self.containers.append(full)
        podman("run", *options, image, *command)
        return full

    def wait(self, name: str, timeout: float = 300) -> int:
        """The container's exit status once it stops; fails the test (after a kill) past `timeout`."""
        try:
            return int(podman("wait", name, timeout=timeout).stdout.strip())
        except subprocess.TimeoutExpired:
            podman("kill", name, check=False)
            pytest.fail(f"{name} still running after {timeout:g} s; this test's containers:\n{self.report()}")

    def report(self) -> str:
        """Each container's state and the end of its log: a node that hangs often waits on another one."""
        states = []
        for name in self.containers:
            state = podman("inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", name, check=False).stdout
            states.append(f"--- {name} ({state.strip()}):\n{self.logs(name)[-3000:]}")
        return "\n".join(states)

    def logs(self, name: str) -> str:
        result = podman("logs", name, check=False)
        return result.stdout + result.stderr

    def exit_code(self, name: str) -> int:
        return int(podman("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip())

    def close(self) -> None:
        for name in reversed(self.containers):
            podman("rm", "--force", "--time", "0", name, check=False)
        for name in reversed(self.networks):
            podman("network", "rm", "--force", name, check=False)


def wait_for_file(path: Path, running: Callable[[], bool], details: Callable[[], str], timeout: float = 180) -> None:
    """Wait until `path` exists while `running()` holds; fail with `details()` otherwise."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert running(), f"stopped before {path.name} appeared:\n{details()[-4000:]}"
        assert time.monotonic() < deadline, f"{path.name} did not appear within {timeout:g} s:\n{details()[-4000:]}"
        time.sleep(0.3)


def shared_volume(path: Path) -> Path:
    """A folder for the runs, writable by the image's user, as a cluster's shared file system is."""
    path.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(PermissionError):
        os.chown(path, IMAGE_USER_ID, IMAGE_USER_ID)
    return path
