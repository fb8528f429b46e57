"""Generating projects: every answer set gives a clean, lint-free project made only of what was chosen."""

import ast
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from .conftest import ANSWER_SETS, TEMPLATE

EXPECTED_FILES = [
    "README.md", "pyproject.toml", ".gitignore", "train.py", "configs/experiment.yaml", "tests/conftest.py",
    "tests/test_configs.py", "tests/example/conftest.py", "docs/checkpoints.md", "src/trainkit/defaults.yaml",
]  # fmt: skip
LEFTOVER = re.compile(r"\{\{|\{%|cookiecutter", re.IGNORECASE)


def package_dir(project, answers):
    return project / "src" / answers.get("package_name", "lightning_mnist")


@pytest.mark.parametrize("answer_set", ANSWER_SETS)
def test_generates_the_expected_layout(projects, answer_set):
    project, answers = projects[answer_set], ANSWER_SETS[answer_set]
    for name in EXPECTED_FILES:
        assert (project / name).is_file(), name
    # The researcher's package holds their code only; the kit is a package of its own beside it.
    package = package_dir(project, answers)
    assert sorted(path.name for path in package.iterdir() if path.name != "__pycache__") == [
        "__init__.py", "data", "models"
    ]  # fmt: skip
    assert (project / "src" / "trainkit" / "cli.py").is_file()


def kit_files(kit: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(kit)): path.read_bytes()
        for path in sorted(kit.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    }


def test_every_project_carries_the_same_kit(projects):
    """One source (trainkit/ in the template), the same bytes in every project whatever the answers."""
    source = kit_files(TEMPLATE / "trainkit" / "src" / "trainkit")
    assert "cluster/sing.py" in source
    for answer_set, project in projects.items():
        assert kit_files(project / "src" / "trainkit") == source, answer_set


def test_git_keeps_every_generated_file(cookies):
    # The project's .gitignore must not hide any of its own files (data/ once hid configs/data/).
    project = cookies.bake().project_path
    subprocess.run(["git", "init", "-q"], cwd=project, check=True)
    subprocess.run(["git", "add", "--all"], cwd=project, check=True)
    tracked = subprocess.run(["git", "ls-files"], cwd=project, capture_output=True, text=True, check=True).stdout
    generated = {path.relative_to(project) for path in project.rglob("*") if path.is_file()}
    generated = {str(path) for path in generated if ".git" not in path.parts}
    assert generated - set(tracked.split()) == set()


@pytest.mark.parametrize("answer_set", ANSWER_SETS)
def test_unselected_parts_are_removed(projects, answer_set):
    project, answers = projects[answer_set], ANSWER_SETS[answer_set]
    assert (project / "LICENSE").exists() == (answers.get("license", "MIT") != "none")
    assert (project / ".github").exists() == (answers.get("github_actions", "yes") == "yes")


@pytest.mark.parametrize("answer_set", ANSWER_SETS)
def test_no_template_syntax_is_left(projects, answer_set):
    project = projects[answer_set]
    for path in project.rglob("*"):
        if path.is_file() and path.name != ".cruft.json" and "__pycache__" not in path.parts:
            text = path.read_text(errors="replace")
            assert not LEFTOVER.search(text), f"{path.relative_to(project)}: {LEFTOVER.search(text).group()}"


@pytest.mark.parametrize("answer_set", ANSWER_SETS)
def test_ruff_lint_and_format_pass(projects, answer_set):
    project = projects[answer_set]
    for command in (["check", "."], ["format", "--check", "."]):
        result = subprocess.run([sys.executable, "-m", "ruff", *command], cwd=project, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr


def test_answers_with_quotes_and_backslashes_stay_data(projects):
    project, answers = projects["quoted"], ANSWER_SETS["quoted"]
    metadata = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    assert metadata["description"] == answers["description"]
    assert metadata["authors"][0]["name"] == answers["author_name"]
    assert metadata["requires-python"] == ">=3.12"
    for path in project.rglob("*.py"):
        ast.parse(path.read_text(), filename=str(path))
    for path in [*project.rglob("*.yaml"), *project.rglob("*.yml")]:
        yaml.safe_load_all(path.read_text())
    assert answers["project_name"] in (project / "README.md").read_text()


def test_answers_reach_the_config(projects):
    config = yaml.safe_load((projects["quoted"] / "configs" / "experiment.yaml").read_text())
    assert config["trainer"]["logger"]["init_args"]["entity"] == "my-team"
    assert config["trainer"]["logger"]["init_args"]["project"] == "jo-s-quoted-net"
    config = yaml.safe_load((projects["minimal"] / "configs" / "experiment.yaml").read_text())
    assert config["cluster"]["main_port"] == 31234
    assert config["trainer"]["logger"]["init_args"]["entity"] is None


OPTIONAL = {"boto3", "optuna", "litdata"}  # each behind an extra of the project: s3, sweep, streaming


def dependency_closure(requirements: list[str]) -> set[str]:
    """Every distribution these requirements pull in, read from the installed packages' metadata."""
    pulled, pending = set(), [Requirement(text) for text in requirements]
    while pending:
        requirement = pending.pop()
        name = canonicalize_name(requirement.name)
        if name in pulled:
            continue
        pulled.add(name)
        for text in metadata.requires(name) or []:
            needed = Requirement(text)
            if needed.marker is None or any(needed.marker.evaluate({"extra": extra}) for extra in
                                            requirement.extras or {""}):  # fmt: skip
                pending.append(needed)
    return pulled


def test_a_default_install_pulls_none_of_the_optional_packages(projects):
    project = tomllib.loads((projects["defaults"] / "pyproject.toml").read_text())["project"]
    closure = dependency_closure(project["dependencies"])
    assert {"lightning", "torch", "wandb", "jsonargparse"} <= closure
    assert not closure & OPTIONAL, f"a default install pulls {closure & OPTIONAL}"
    with_extras = dependency_closure([f"{extra}" for extras in ("s3", "sweep", "streaming")
                                      for extra in project["optional-dependencies"][extras]])  # fmt: skip
    assert with_extras >= OPTIONAL
