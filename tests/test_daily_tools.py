"""The quality tools a generated project brings: pre-commit hooks, the GitHub Actions workflow, the LICENSE."""

import os
import re
import subprocess
import sys
import tomllib
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

# pre-commit's `identify` package ships the SPDX texts of common licenses: an independent reference.
from identify.vendor.licenses import LICENSES

from .conftest import ANSWER_SETS

WORKFLOW = Path(".github/workflows/tests.yml")
# Run git with no user or system configuration, so nothing on the machine changes what the hooks see.
GIT_ENV = {"GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1"}


def bake(cookies, **answers) -> Path:
    result = cookies.bake(extra_context=answers)
    assert result.exit_code == 0, result.exception
    return result.project_path


def run(*command: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, env={**os.environ, **GIT_ENV}, capture_output=True, text=True)


def check_workflow(path: Path) -> subprocess.CompletedProcess:
    schema = "vendor.github-workflows"  # GitHub's workflow schema, shipped with check-jsonschema
    return run(sys.executable, "-m", "check_jsonschema", "--builtin-schema", schema, str(path), cwd=path.parent)


def pre_commit(project: Path) -> subprocess.CompletedProcess:
    return run(sys.executable, "-m", "pre_commit", "run", "--all-files", "--color=never", cwd=project)


@pytest.mark.parametrize("answer_set", ANSWER_SETS)
def test_pre_commit_passes_on_a_freshly_generated_project(cookies, answer_set):
    project = bake(cookies, **ANSWER_SETS[answer_set])
    run("git", "init", "-q", cwd=project)
    run("git", "add", "-A", cwd=project)

    result = pre_commit(project)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    assert "ruff check" in result.stdout and "check yaml" in result.stdout
    assert run("git", "diff", "--stat", cwd=project).stdout == "", "a hook changed a generated file"


def test_pre_commit_fixes_and_refuses_what_it_should(cookies):
    project = bake(cookies)
    run("git", "init", "-q", cwd=project)
    scratch = project / "src" / "lightning_mnist" / "scratch.py"
    scratch.write_text("import os\nx=1   \n\n\n")  # unused import, unformatted, trailing spaces, extra blank lines
    (project / "configs" / "broken.yaml").write_text("model: [1, 2\n")
    run("git", "add", "-A", cwd=project)

    result = pre_commit(project)
    assert result.returncode != 0
    assert scratch.read_text() == "x = 1\n"
    assert re.search(r"check yaml\.+Failed", result.stdout), result.stdout


def test_workflow_is_valid_and_uses_the_chosen_python(cookies, tmp_path):
    # The version must stay a string in YAML (a bare 3.10 would be the number 3.1).
    project = bake(cookies, python_version="3.13")
    workflow = project / WORKFLOW
    check = check_workflow(workflow)
    assert check.returncode == 0, check.stdout + check.stderr

    steps = yaml.safe_load(workflow.read_text())["jobs"]["test"]["steps"]
    python = next(step for step in steps if step.get("uses", "").startswith("actions/setup-python"))
    assert python["with"]["python-version"] == "3.13"
    commands = [step["run"] for step in steps if "run" in step]
    cpu_torch = next(i for i, c in enumerate(commands) if "download.pytorch.org/whl/cpu" in c and "torch" in c)
    project_install = next(i for i, c in enumerate(commands) if 'pip install -e ".[dev]"' in c)
    assert cpu_torch < project_install, "CPU torch must be installed first, or pip pulls the CUDA build"
    assert any("ruff check" in c for c in commands) and any(c.strip() == "pytest" for c in commands)

    # The image job builds the project's own Dockerfile on a CPU base and trains inside the image.
    image_job = yaml.safe_load(workflow.read_text())["jobs"]["image"]
    image_steps = [step["run"] for step in image_job["steps"] if "run" in step]
    built = next(c for c in image_steps if "docker build --build-arg BASE_IMAGE=cpu-base" in c)
    image = built.split("--tag")[1].split()[0]
    assert any(f"docker run --rm {image} python -m trainkit.cluster" in c for c in image_steps)
    assert any(image in c and "python train.py fit --config configs/experiment.yaml" in c for c in image_steps)

    broken = tmp_path / "broken.yml"
    text = workflow.read_text()
    assert "runs-on:" in text
    broken.write_text(re.sub(r"^\s*runs-on:.*\n", "", text, flags=re.MULTILINE))
    rejected = check_workflow(broken)
    assert rejected.returncode != 0
    assert "'runs-on' is a required property" in rejected.stdout


@pytest.mark.parametrize("spdx", ["MIT", "Apache-2.0", "BSD-3-Clause"])
def test_license_is_the_standard_text_with_year_and_author(cookies, spdx):
    author = 'Ada O\'Neil "Q" \\'
    project = bake(cookies, license=spdx, author_name=author)
    year = str(datetime.now(UTC).year)
    expected = dict(LICENSES)[spdx]
    expected = expected.replace("[year]", year).replace("[fullname]", author)  # MIT and BSD
    expected = expected.replace("[yyyy] [name of copyright owner]", f"{year} {author}")  # Apache's appendix
    # Compare word by word: the reference texts differ from the canonical files only in indentation.
    assert (project / "LICENSE").read_text().split() == expected.split()
    assert tomllib.loads((project / "pyproject.toml").read_text())["project"]["license"] == spdx
