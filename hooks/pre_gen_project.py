"""Refuse bad answers before cookiecutter writes anything.

Each problem is reported on one line; any problem exits non-zero, so generation stops.
The answers are read as JSON data, never pasted into code, so quotes or backslashes
in a name cannot break this file.
"""

import json
import keyword
import re
import sys

ANSWERS = json.loads(r"""{{ cookiecutter | jsonify }}""")

SLUG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# Kubernetes names pods `<job>-<index>` and they must be DNS labels (63 characters at most).
JOB_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,50}[a-z0-9])?")
CHOICES = {
    "python_version": ("3.11", "3.12", "3.13"),
    "license": ("MIT", "Apache-2.0", "BSD-3-Clause", "none"),
    "github_actions": ("yes", "no"),
}


def problems(answers: dict) -> list[str]:
    found = []
    slug = answers["project_slug"]
    if not SLUG.fullmatch(slug):
        found.append(
            f"project_slug {slug!r} is not a valid directory name: use letters, digits, '.', '_' and '-',"
            " starting with a letter or digit"
        )
    package = answers["package_name"]
    if not package.isidentifier() or not package.isascii():
        found.append(f"package_name {package!r} is not a valid Python identifier")
    elif keyword.iskeyword(package) or keyword.issoftkeyword(package):
        found.append(f"package_name {package!r} is a Python keyword")
    elif package in sys.stdlib_module_names or package in ("torch", "lightning", "wandb", "tests"):
        found.append(f"package_name {package!r} would shadow the module of the same name")
    for key, allowed in CHOICES.items():
        if answers[key] not in allowed:
            found.append(f"{key} {answers[key]!r} is not one of: {', '.join(allowed)}")
    if not JOB_NAME.fullmatch(answers["job_name"]):
        found.append(
            f"job_name {answers['job_name']!r} must be lower-case letters, digits and '-',"
            " start and end with a letter or digit, at most 52 characters"
        )
    for key in ("num_nodes", "gpus_per_node"):
        if not answers[key].isdigit() or int(answers[key]) < 1:
            found.append(f"{key} {answers[key]!r} must be a whole number of at least 1")
    port = answers["main_port"]
    if not port.isdigit() or not 1024 <= int(port) <= 65535:
        found.append(f"main_port {port!r} must be a number from 1024 to 65535")
    for key in ("project_name", "docker_base_image", "docker_image", "wandb_project"):
        if not answers[key].strip():
            found.append(f"{key} must not be empty")
    return found


if __name__ == "__main__":
    errors = problems(ANSWERS)
    for error in errors:
        print(f"error: {error}", file=sys.stderr)
    sys.exit(1 if errors else 0)
