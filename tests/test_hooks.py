"""The pre-generation hook refuses bad answers with one clear line and writes nothing."""

import subprocess
import sys

import pytest

from .conftest import TEMPLATE

# Names derived from the slug, given explicitly so that only the slug is wrong.
VALID_DERIVED = {"package_name": "ok_package", "job_name": "ok-job"}
BAD_ANSWERS = [
    ({"project_slug": "my project", **VALID_DERIVED}, "project_slug 'my project' is not a valid directory name"),
    ({"project_slug": "../escape", **VALID_DERIVED}, "project_slug '../escape' is not a valid directory name"),
    ({"package_name": "my-package"}, "package_name 'my-package' is not a valid Python identifier"),
    ({"package_name": "2fast"}, "package_name '2fast' is not a valid Python identifier"),
    ({"package_name": "class"}, "package_name 'class' is a Python keyword"),
    ({"package_name": "json"}, "package_name 'json' would shadow the module of the same name"),
    ({"project_name": "123 Go"}, "package_name '123_go' is not a valid Python identifier"),
    ({"job_name": "My_Job"}, "job_name 'My_Job' must be lower-case letters, digits and '-'"),
    ({"gpus_per_node": "0"}, "gpus_per_node '0' must be a whole number of at least 1"),
    ({"num_nodes": "two"}, "num_nodes 'two' must be a whole number of at least 1"),
    ({"main_port": "80"}, "main_port '80' must be a number from 1024 to 65535"),
    ({"docker_image": " "}, "docker_image must not be empty"),
]


def bake(tmp_path, answers: dict[str, str]) -> subprocess.CompletedProcess:
    """The real cookiecutter command, with no terminal, as a user or a script runs it."""
    assignments = [f"{key}={value}" for key, value in answers.items()]
    return subprocess.run(
        [sys.executable, "-m", "cookiecutter", "--no-input", "-o", str(tmp_path), str(TEMPLATE), *assignments],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=120,
    )


@pytest.mark.parametrize(("answers", "message"), BAD_ANSWERS, ids=[str(a) for a, _ in BAD_ANSWERS])
def test_bad_answer_is_refused_before_anything_is_written(tmp_path, answers, message):
    result = bake(tmp_path, answers)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("key", "value"), [("license", "WTFPL"), ("python_version", "2.7"), ("github_actions", "maybe")]
)
def test_unknown_choice_is_refused_naming_it(tmp_path, key, value):
    # cookiecutter checks choices itself before the hook runs (the hook checks them again for
    # older cookiecutters); either way the last line names the answer and nothing is written.
    result = bake(tmp_path, {key: value})
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert key in last_line and value in last_line, result.stderr
    assert list(tmp_path.iterdir()) == []


def test_every_problem_gets_its_own_line(tmp_path):
    result = bake(tmp_path, {"package_name": "class", "gpus_per_node": "-2", "main_port": "1"})
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 3, result.stderr


def test_defaults_generate_without_a_terminal(tmp_path):
    result = bake(tmp_path, {})
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "lightning-mnist" / "train.py").is_file()
    assert "Next steps" in result.stdout
