"""Template updates with cruft: a project made from one template commit pulls a later commit cleanly.

The template is this working tree, committed to a temporary git repository (commit 1); a project is
made from it, the template changes (commit 2: a new config, a kit fix, a launch recipe edit), and
`cruft update` brings every change into the project while the researcher's own edits stay.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import TEMPLATE

# No user or system git configuration, and a fixed identity for the commits made here.
GIT_ENV = {
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_NAME": "Template Test",
    "GIT_AUTHOR_EMAIL": "template-test@example.com",
    "GIT_COMMITTER_NAME": "Template Test",
    "GIT_COMMITTER_EMAIL": "template-test@example.com",
}
NEW_CONFIG = "configs/exp/long_run.yaml"
KIT_FILE = "src/trainkit/cluster/sing.py"  # in the project; in the template under trainkit/
RECIPE = "launch/slurm/train.sbatch"
KIT_FIX = "\n# A kit fix that reaches every project.\n"
RECIPE_EDIT = "\n# A recipe change that reaches every project.\n"
RESEARCH_FILE = "src/{package}/models/image_classifier.py"
RESEARCH_EDIT = "\n\n# The researcher's own change.\n"


def run(*command: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=cwd, env={**os.environ, **GIT_ENV}, capture_output=True, text=True)
    if check:
        assert result.returncode == 0, f"{command}: {result.stdout[-3000:]}{result.stderr[-3000:]}"
    return result


def cruft(*args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    return run(sys.executable, "-m", "cruft", *args, cwd=cwd, check=check)


def commit_all(repo: Path, message: str) -> str:
    run("git", "add", "-A", cwd=repo)
    run("git", "commit", "-q", "-m", message, cwd=repo)
    return run("git", "rev-parse", "HEAD", cwd=repo).stdout.strip()


@pytest.fixture
def template_repo(tmp_path) -> Path:
    """The template as it is in this working tree, as commit 1 of a new git repository."""
    repo = tmp_path / "template"
    repo.mkdir()
    shutil.copy2(TEMPLATE / "cookiecutter.json", repo)
    for folder in ("hooks", "trainkit", "{{cookiecutter.project_slug}}"):
        # symlinks=True: the project's src/trainkit stays a link to the kit, its one source.
        ignore = shutil.ignore_patterns("__pycache__", ".*_cache")
        shutil.copytree(TEMPLATE / folder, repo / folder, ignore=ignore, symlinks=True)
    run("git", "init", "-q", cwd=repo)
    commit_all(repo, "template, commit 1")
    return repo


def change_template(repo: Path) -> str:
    """Commit 2, a typical template change: a new experiment config that uses an answer, and an edit."""
    project = repo / "{{cookiecutter.project_slug}}"
    new_config = project / NEW_CONFIG
    assert not new_config.exists(), f"pick another name: the template now has {NEW_CONFIG}"
    new_config.parent.mkdir(parents=True, exist_ok=True)
    new_config.write_text(
        "# A longer run of {{ cookiecutter.project_name }}:\n"
        f"#   python train.py fit --config configs/experiment.yaml --config {NEW_CONFIG}\n"
        "trainer:\n"
        "  max_epochs: 20\n"
    )
    with (project / ".gitignore").open("a") as gitignore:
        gitignore.write("\n# Editors\n.idea/\n.vscode/\n")
    with (repo / "trainkit" / KIT_FILE).open("a") as kit_file:
        kit_file.write(KIT_FIX)
    with (project / RECIPE).open("a") as recipe:
        recipe.write(RECIPE_EDIT)
    return commit_all(repo, "template, commit 2")


def init_project(project: Path, package: str) -> None:
    """The researcher's repository: generated files committed, then changes of their own."""
    run("git", "init", "-q", cwd=project)
    commit_all(project, "generated")
    with (project / "README.md").open("a") as readme:
        readme.write("\nNotes of my own.\n")
    with (project / RESEARCH_FILE.format(package=package)).open("a") as research:
        research.write(RESEARCH_EDIT)
    commit_all(project, "my notes and my model")


def assert_updated(project: Path, template_head: str, project_name: str, package: str) -> None:
    assert not list(project.rglob("*.rej")), "the update did not apply cleanly"
    assert (project / NEW_CONFIG).read_text().startswith(f"# A longer run of {project_name}:\n")
    assert (project / ".gitignore").read_text().endswith("\n# Editors\n.idea/\n.vscode/\n")
    assert (project / KIT_FILE).read_text().endswith(KIT_FIX), "the kit fix did not arrive"
    assert (project / RECIPE).read_text().endswith(RECIPE_EDIT), "the launch recipe change did not arrive"
    assert (project / "README.md").read_text().endswith("\nNotes of my own.\n"), "the researcher's change was lost"
    research = (project / RESEARCH_FILE.format(package=package)).read_text()
    assert research.endswith(RESEARCH_EDIT), "the researcher's model was changed"
    assert json.loads((project / ".cruft.json").read_text())["commit"] == template_head
    assert "up to date" in cruft("check", cwd=project).stdout
    for ruff in (["check", "."], ["format", "--check", "."]):
        run(sys.executable, "-m", "ruff", *ruff, cwd=project)


def test_cruft_create_records_the_template_and_update_pulls_a_later_commit(template_repo, tmp_path):
    cruft("create", "--no-input", "--default-config", "--output-dir", str(tmp_path), str(template_repo), cwd=tmp_path)
    project = tmp_path / "lightning-mnist"
    record = json.loads((project / ".cruft.json").read_text())
    assert record["template"] == str(template_repo)
    assert record["commit"] == run("git", "rev-parse", "HEAD", cwd=template_repo).stdout.strip()
    assert record["context"]["cookiecutter"]["project_name"] == "Lightning MNIST"
    init_project(project, "lightning_mnist")

    head = change_template(template_repo)
    assert cruft("check", cwd=project, check=False).returncode != 0, "cruft check missed the new template commit"
    cruft("update", "--skip-apply-ask", cwd=project)
    assert_updated(project, head, "Lightning MNIST", "lightning_mnist")


def test_a_plain_cookiecutter_project_is_linked_then_updated(template_repo, cookies):
    answers = {"project_name": "Vision Lab", "license": "BSD-3-Clause"}
    result = cookies.bake(extra_context=answers, template=str(template_repo))
    assert result.exit_code == 0, result.exception
    project = result.project_path
    init_project(project, "vision_lab")
    # The answers given at generation, so that the template's later files are rendered with them.
    link = ["link", "--no-input", "--default-config", "--extra-context", json.dumps(answers), str(template_repo)]
    cruft(*link, cwd=project)
    commit_all(project, "link to the template")

    head = change_template(template_repo)
    cruft("update", "--skip-apply-ask", cwd=project)
    assert_updated(project, head, "Vision Lab", "vision_lab")
    assert (project / "LICENSE").read_text().startswith("BSD 3-Clause License")
