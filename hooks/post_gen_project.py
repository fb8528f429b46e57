"""Tidy the project: remove what the answers did not select, and print the next steps."""

import json
import shutil
from pathlib import Path

ANSWERS = json.loads(r"""{{ cookiecutter | jsonify }}""")

UNSELECTED = {
    "LICENSE": ANSWERS["license"] == "none",
    ".github": ANSWERS["github_actions"] == "no",
}

NEXT_STEPS = """
Created {slug}/. Next steps:

  cd {slug}
  python -m venv .venv && . .venv/bin/activate
  pip install -e ".[dev]"
  python train.py fit --config configs/experiment.yaml
  pytest

README.md explains the configs, logging and how to launch on a cluster.
"""


def remove_bytecode(project: Path) -> None:
    """The kit is copied from the template's own folder, with whatever Python cached there."""
    for cache in (project / "src" / "trainkit").rglob("__pycache__"):
        shutil.rmtree(cache)


def remove_unselected(project: Path) -> None:
    for name, unselected in UNSELECTED.items():
        path = project / name
        if not unselected or not path.exists():
            continue
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


if __name__ == "__main__":
    remove_bytecode(Path.cwd())
    remove_unselected(Path.cwd())
    print(NEXT_STEPS.format(slug=ANSWERS["project_slug"]))
