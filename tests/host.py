"""What the tests that run real daemons need from this machine: root, and Debian packages."""

import os
import subprocess

import pytest


def root_or_skip(what: str) -> None:
    """Skip without root, with the reason, except under CI, which must run every platform for real."""
    if os.geteuid() == 0:
        return
    reason = f"{what} needs root"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run this test, but {reason}")
    pytest.skip(reason)


def apt_install(packages: tuple[str, ...]) -> None:
    """Install Debian packages (root only); refresh the package lists once if needed.

    Tests run side by side (pytest -n): one waits for another's apt-get to release dpkg's lock."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    apt_get = ["apt-get", "-o", "DPkg::Lock::Timeout=600"]
    command = [*apt_get, "install", "-y", "-q", "--no-install-recommends", *packages]
    if subprocess.run(command, env=env, capture_output=True, check=False).returncode != 0:
        subprocess.run([*apt_get, "update", "-q"], env=env, capture_output=True, check=True)
        result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"apt-get install {' '.join(packages)} failed:\n{result.stdout[-2000:]}{result.stderr}")
