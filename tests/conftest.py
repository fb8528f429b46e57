"""Fixtures of the template's tests: projects generated once per answer set, and real MNIST digits."""

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

TEMPLATE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TEMPLATE / "scripts"))

from mnist_sample import write_split  # noqa: E402

# Answer sets a project is generated with. Besides the defaults: names with quotes and
# backslashes, a package name unlike the slug, every other choice of each option.
ANSWER_SETS = {
    "defaults": {},
    "quoted": {
        "project_name": 'Jo\'s "Quoted" \\ Net',
        "package_name": "quoted_net",
        "description": 'Says "hi" \\ and \'bye\'; """ ends here',
        "author_name": 'O\'Brien "Bob" \\',
        "python_version": "3.12",
        "license": "Apache-2.0",
        "wandb_entity": "my-team",
        "github_actions": "no",
        "job_name": "qnet",
        "num_nodes": "3",
        "gpus_per_node": "4",
    },
    "minimal": {
        "project_name": "Vision Lab",
        "package_name": "vlab",
        "python_version": "3.13",
        "license": "none",
        "main_port": "31234",
        "gpus_per_node": "1",
    },
}


def make_importable(project: Path) -> None:
    """Put a generated project's package on PYTHONPATH for this test session and its subprocesses.

    This stands in for `pip install -e .` (its dependencies are in this environment already) without
    changing the environment, so test sessions never see each other's projects. The demo test
    installs the default project for real.
    """
    paths = [str(project / "src"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    sys.path.insert(0, paths[0])


@pytest.fixture(scope="session")
def projects(cookies_session) -> dict[str, Path]:
    """Each answer set generated once and made importable; tests must not modify these trees."""
    generated = {}
    for name, answers in ANSWER_SETS.items():
        result = cookies_session.bake(extra_context=answers)
        assert result.exit_code == 0, result.exception
        generated[name] = result.project_path
        make_importable(result.project_path)
    return generated


@pytest.fixture(scope="session", autouse=True)
def temporary_files_of_this_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every temporary file of the tests and of the commands they run goes to one folder, removed at the end.

    Left in the system's: cookiecutter's script for each hook (never deleted; hundreds of projects are
    generated here), torchrun's log folder (never deleted), and the temporary files and sockets of processes a
    drill kills. A short path, because wandb's sockets live there.
    """
    tmp_path_factory.getbasetemp()  # pytest's own folder stays in the system's, kept for a look after a failure
    folder = tempfile.mkdtemp(prefix="template-tests-")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", folder)
        patch.setattr(tempfile, "tempdir", folder)
        yield
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def default_project(projects) -> Path:
    return projects["defaults"]


@pytest.fixture(scope="session")
def real_mnist(tmp_path_factory) -> Path:
    """The shipped real MNIST sample as torchvision's layout: 8,000 training and 2,000 held-out digits."""
    root = tmp_path_factory.mktemp("real-mnist")
    write_split(root, train=8000)
    return root


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "containers: builds the generated image and runs it (podman, dockerd); root")
