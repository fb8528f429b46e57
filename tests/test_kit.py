"""The kit as a package of its own: lint-clean under its own settings, free of template syntax, installable; and the
template repository's own code lint-clean under its settings (ruff.toml)."""

import subprocess
import sys

from .conftest import TEMPLATE

KIT = TEMPLATE / "trainkit"


def test_the_kit_is_lint_clean_under_its_own_settings():
    for command in (["check", "."], ["format", "--check", "."]):
        result = subprocess.run([sys.executable, "-m", "ruff", *command], cwd=KIT, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr


def test_the_template_repositorys_own_code_is_lint_clean():
    # Named folders: ruff would otherwise read the template's pyproject.toml, which is template syntax.
    own_code = ["bench", "scripts", "tests", "hooks"]
    for command in (["check", *own_code], ["format", "--check", *own_code]):
        result = subprocess.run([sys.executable, "-m", "ruff", *command], cwd=TEMPLATE, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr


def test_the_kit_holds_no_template_syntax():
    for path in KIT.rglob("*"):
        if path.is_file() and "__pycache__" not in path.parts:
            text = path.read_text(errors="replace")
            assert "{{" not in text and "{%" not in text, path.relative_to(KIT)


def test_the_kit_builds_as_a_wheel_of_its_own(tmp_path):
    """`pip install ./trainkit` works: the wheel holds the package, its defaults and nothing of a project."""
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(KIT)]
    result = subprocess.run(build, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (wheel,) = tmp_path.glob("trainkit-*.whl")
    names = subprocess.run([sys.executable, "-m", "zipfile", "-l", str(wheel)], capture_output=True, text=True).stdout
    assert "trainkit/defaults.yaml" in names and "trainkit/cluster/sing.py" in names
    assert "tests/" not in names
