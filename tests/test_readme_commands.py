"""Every command the generated project's READMEs show runs here on the shipped real digits, or is listed elsewhere.

The commands are read from the ```bash blocks of README.md, docs/*.md and launch/*/README.md (`\\`
continuations joined, `# comments` dropped), so the test follows the READMEs as they change. The
commands that can run on one CPU machine without network run in order, in one copy of the default
project, as typed, with small-run options appended (never rewritten): README.md and then docs/*.md
from a project without runs, as a reader who follows them from the start, and each launch README
from a project without runs. A command that cannot run here is listed in NOT_RUN_HERE with the test
that runs it for real, or why nothing does; a README command that is neither run nor listed fails
the first test, so no new command goes untested unnoticed.
"""

import ast
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from .conftest import TEMPLATE
from .launch_runs import launch_environment

PACKAGE = "lightning_mnist"  # the default project's package: the commands below are as its READMEs show them

# Appended to train.py commands: a few batches of each loop.
SMALL_RUN = {
    "--trainer.max_epochs": "1",
    "--trainer.limit_train_batches": "5",
    "--trainer.limit_val_batches": "2",
    "--trainer.limit_test_batches": "4",
    "--trainer.limit_predict_batches": "4",
}


def nothing_runs(command: str) -> bool:
    return "--help" in command or "--print_config" in command


def small_run(command: str) -> list[str]:
    """SMALL_RUN but for the settings the command makes itself (a command's own max_epochs stays)."""
    if nothing_runs(command):
        return []
    own = {word.partition("=")[0] for word in shlex.split(command)}
    return [word for option, value in SMALL_RUN.items() if option not in own for word in (option, value)]


def sweep_options(command: str) -> list[str]:
    """Two trials, each a small run; the command's own options for the runs, after its `--`, stay."""
    return small_run(command) if " -- " in command else ["--count", "2", "--", *small_run(command)]


# The commands that run here, by prefix: what is appended to them to keep them short.
RUN_HERE = {
    "python train.py ": small_run,
    "NPROC_PER_NODE=2 bash launch/torchrun/single_node.sh": small_run,  # 2 processes over gloo
    "python -m trainkit.chunks ": lambda command: [],
    "python -m trainkit.sweep ": sweep_options,
    "python -m trainkit.checkpoints.provenance ": lambda command: [],
    # Offline: the project's dependencies and extras resolve from this environment; nothing is installed.
    'pip install -e ".[dev]"': lambda command: ["--no-index", "--no-build-isolation", "--dry-run"],
    "pre-commit install": lambda command: [],  # writes the git hook (the test's project is a git repository)
}


@dataclass(frozen=True)
class Elsewhere:
    """Why a command cannot run here, and the test that runs it for real, if any: "tests/<file>::<name>" of
    the template (trainkit/tests/... for the kit's), or "project: tests/<file>::<name>" of the generated project."""

    why: str
    test: str = ""


NOT_RUN_HERE = {
    "python -m venv .venv": Elsewhere("makes the environment these tests already run in"),
    "pytest": Elsewhere(
        "the project's own suite", "tests/test_generated_projects.py::test_generated_test_suite_passes"
    ),
    "pre-commit run --all-files": Elsewhere(
        "installs the hooks' tools from PyPI",
        "tests/test_daily_tools.py::test_pre_commit_passes_on_a_freshly_generated_project",
    ),
    "docker build": Elsewhere(
        "needs Docker and a registry to push to",
        "tests/test_containers.py::test_two_containers_form_one_job_by_their_dns_names",
    ),
    "docker push": Elsewhere("needs a registry"),
    "docker run ": Elsewhere(
        "needs Docker and GPUs; the image's own command runs in podman",
        "tests/test_containers.py::test_two_containers_form_one_job_by_their_dns_names",
    ),
    "docker node update": Elsewhere("labels the machines of a multi-machine Swarm; the test's Swarm is one machine"),
    "docker stack ": Elsewhere("needs a Docker Swarm", "tests/test_containers.py::test_swarm_stack_trains_as_one_job"),
    "docker service logs": Elsewhere(
        "needs a Docker Swarm", "tests/test_containers.py::test_swarm_stack_trains_as_one_job"
    ),
    "kubectl ": Elsewhere(
        "needs a Kubernetes cluster; the manifests are validated and each pod's variables run",
        "tests/test_launch_recipes.py::test_the_project_reads_each_pod_as_its_node",
    ),
    "sbatch ": Elsewhere("needs Slurm", "tests/test_slurm.py::test_generated_sbatch_script_trains_as_one_job"),
    "squeue ": Elsewhere("needs Slurm", "tests/test_slurm.py::test_generated_sbatch_script_trains_as_one_job"),
    "scancel ": Elsewhere("needs Slurm", "tests/test_slurm.py::test_preempted_job_is_requeued_and_resumes"),
    "tail -f ": Elsewhere(
        "follows a Slurm job's log", "tests/test_slurm.py::test_generated_sbatch_script_trains_as_one_job"
    ),
    "bash launch/torchrun/single_node.sh": Elsewhere(
        "one process per GPU: torchrun refuses to start without one; with NPROC_PER_NODE=2 it runs here",
        "tests/test_launch_recipes.py::test_torchrun_scripts_train_on_cpu",
    ),
    "MASTER_ADDR=<first machine> bash launch/torchrun/multi_node.sh": Elsewhere(
        "runs on several machines", "tests/test_launch_recipes.py::test_torchrun_scripts_train_on_cpu"
    ),
    "cruft update": Elsewhere(
        "needs the template's repository and a later commit of it",
        "tests/test_template_update.py::test_cruft_create_records_the_template_and_update_pulls_a_later_commit",
    ),
    "torchrun --nnodes $SING_WORLD_SIZE": Elsewhere(
        "SING's variables, on several nodes",
        "trainkit/tests/test_multinode.py::test_torchrun_inside_sing_nodes_forms_one_job_of_every_process",
    ),
}

# Anywhere in a command: what it needs cannot be had here.
NEEDS = {"s3://": "an object store"}

# What a command's output must show besides exit status 0, by prefix: the text, and what its absence means.
TRAINED = (" val/acc=", "it trained nothing: it resumed a run that had reached max_epochs; give it a run directory")
EXPECTED_OUTPUT = {
    "python train.py fit ": TRAINED,
    "NPROC_PER_NODE=2 bash launch/torchrun/single_node.sh": TRAINED,
    "python train.py test --config configs/experiment.yaml --ckpt_path best": (
        "/checkpoints/best-",
        "it restored no best-* file",
    ),
    "python -m trainkit.checkpoints.provenance runs/": ("versions  python ", "it showed no provenance"),
}


def without_comment(line: str) -> str:
    """The line up to a `#` that starts a shell comment (outside quotes, at the start or after a space)."""
    quote = None
    for at, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (at == 0 or line[at - 1].isspace()):
            return line[:at]
    return line


def bash_commands(readme: Path) -> list[str]:
    """The commands of the README's ```bash blocks, one per (joined) line, whitespace collapsed."""
    commands, language, pending = [], None, ""
    for line in readme.read_text().splitlines():
        fence = line.strip()
        if fence.startswith("```"):
            language = fence[3:].strip() if language is None else None
            continue
        if language != "bash":
            continue
        line = without_comment(line).rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        command, pending = " ".join((pending + line).split()), ""
        if command:
            commands.append(command)
    return commands


def readme_commands(project: Path) -> list[tuple[str, str]]:
    """(README, command) for the project README's commands, then the kit's docs', then each launch recipe's."""
    readmes = [project / "README.md", *sorted(project.glob("docs/*.md")), *sorted(project.glob("launch/*/README.md"))]
    return [(str(readme.relative_to(project)), command) for readme in readmes for command in bash_commands(readme)]


def everyday_flags() -> list[tuple[str, ...]]:
    """The flag sets the kit's tests/test_everyday_flags.py trains with (its EVERYDAY_FLAGS)."""
    module = ast.parse((TEMPLATE / "trainkit" / "tests" / "test_everyday_flags.py").read_text())
    (value,) = (node.value for node in module.body if isinstance(node, ast.Assign)
                and any(getattr(target, "id", None) == "EVERYDAY_FLAGS" for target in node.targets))  # fmt: skip
    return [tuple(flags) for flags in ast.literal_eval(value).values()]


def longest_prefix(command: str, table: dict) -> str | None:
    matches = [prefix for prefix in table if command.startswith(prefix)]
    return max(matches, key=len, default=None)


def how_checked(command: str, flags: list[tuple[str, ...]]) -> str:
    """How this test accounts for a command: run, flag, elsewhere or needs; "" when it does not."""
    if command.startswith("--"):
        return "flag" if tuple(shlex.split(command)) in flags else ""
    if any(needed in command for needed in NEEDS):
        return "needs"
    if longest_prefix(command, NOT_RUN_HERE) is not None:
        return "elsewhere"
    return "run" if longest_prefix(command, RUN_HERE) is not None else ""


def test_every_readme_command_is_run_or_accounted_for(default_project):
    commands = readme_commands(default_project)
    assert len(commands) > 20, commands  # the blocks were found
    flags = everyday_flags()
    unaccounted = [f"{readme}: {command}" for readme, command in commands if not how_checked(command, flags)]
    assert not unaccounted, (
        "README commands that are neither run by this test nor listed in its NOT_RUN_HERE (a flag line must be one"
        " of the kit's tests/test_everyday_flags.py EVERYDAY_FLAGS):\n" + "\n".join(unaccounted)
    )
    listed = [prefix for prefix in NOT_RUN_HERE if not any(command.startswith(prefix) for _, command in commands)]
    assert not listed, f"NOT_RUN_HERE lists commands no README shows any more: {listed}"
    for prefix, elsewhere in NOT_RUN_HERE.items():
        if elsewhere.test:
            where, _, name = elsewhere.test.partition("::")
            root = default_project if where.startswith("project: ") else TEMPLATE
            path = root / where.removeprefix("project: ")
            assert path.is_file() and f"def {name}(" in path.read_text(), f"{prefix}: no test {elsewhere.test}"


def write_what_the_reader_writes(project: Path, readme: str) -> None:
    """The files "Make it yours" has the reader write: its model config as shown, the example under the new names."""
    yaml_blocks = [block.split("```")[0] for block in readme.split("```yaml\n")[1:]]
    (model_config,) = [block for block in yaml_blocks if f"{PACKAGE}.models.my_model.MyModel" in block]
    (project / "configs" / "model" / "my_model.yaml").write_text(re.sub(r"(?m)^ {3}", "", model_config))
    example = f"from {PACKAGE}.models.image_classifier import ImageClassifier\n\n\n"
    (project / "src" / PACKAGE / "models" / "my_model.py").write_text(
        f"{example}class MyModel(ImageClassifier):\n    pass\n"
    )
    shutil.copy(project / "configs" / "data" / "mnist.yaml", project / "configs" / "data" / "my_data.yaml")


@pytest.fixture(scope="module")
def reader_project(default_project, real_mnist, tmp_path_factory) -> Path:
    """A copy of the default project as a reader has it: a git repository, the shipped digits where
    `download: true` finds them (torchvision downloads only missing files), the files the README has them write."""
    project = tmp_path_factory.mktemp("reader") / default_project.name
    shutil.copytree(default_project, project, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(real_mnist / "MNIST", project / "data" / "MNIST", dirs_exist_ok=True)
    write_what_the_reader_writes(project, (project / "README.md").read_text())
    subprocess.run(["git", "init", "-q"], cwd=project, env=offline_environment(project), check=True)
    return project


def offline_environment(project: Path) -> dict[str, str]:
    """The project importable, no cluster variables, no git configuration of this machine (pre-commit refuses
    a core.hooksPath), and any HTTP(S) request refused: nothing is downloaded."""
    unreachable = "http://127.0.0.1:9"
    env = launch_environment(project, HTTP_PROXY=unreachable, HTTPS_PROXY=unreachable, NO_PROXY="",
                             GIT_CONFIG_GLOBAL="/dev/null", GIT_CONFIG_NOSYSTEM="1")  # fmt: skip
    env.update(http_proxy=unreachable, https_proxy=unreachable, no_proxy="")
    env.pop("WANDB_API_KEY", None)
    return env


def expected_output(command: str) -> tuple[str, str]:
    prefix = longest_prefix(command, EXPECTED_OUTPUT)
    return ("", "") if prefix is None or nothing_runs(command) else EXPECTED_OUTPUT[prefix]


def test_readme_commands_run_on_the_shipped_digits(reader_project):
    flags = everyday_flags()
    runnable = [(readme, command) for readme, command in readme_commands(reader_project)
                if how_checked(command, flags) == "run"]  # fmt: skip
    env = offline_environment(reader_project)
    raw_files = {path: path.stat().st_mtime_ns for path in (reader_project / "data" / "MNIST" / "raw").iterdir()}
    failures, previous = [], None
    for readme, command in runnable:
        # The docs pages go on from the README's quick start (a reader has trained once); each launch README
        # starts from a project without runs.
        chapter = readme if readme.startswith("launch/") else "README.md and docs"
        if chapter != previous:
            shutil.rmtree(reader_project / "runs", ignore_errors=True)
            previous = chapter
        line = " ".join([command, *map(shlex.quote, RUN_HERE[longest_prefix(command, RUN_HERE)](command))])
        try:
            result = subprocess.run(["bash", "-c", line], cwd=reader_project, env=env, capture_output=True,
                                    text=True, timeout=600)  # fmt: skip
        except subprocess.TimeoutExpired:
            failures.append(f"{readme}: {line}\n  did not finish in 600 s")
            continue
        output = result.stdout + result.stderr
        expected, meaning = expected_output(command)
        if result.returncode != 0 or "Traceback" in output or expected not in output:
            missing = f", without {expected!r} in its output ({meaning})" if expected not in output else ""
            failures.append(f"{readme}: {line}\n  exit {result.returncode}{missing}:\n{output[-2500:]}")
    assert not failures, f"{len(failures)} of {len(runnable)} README commands failed:\n\n" + "\n\n".join(failures)
    assert {path: path.stat().st_mtime_ns for path in raw_files} == raw_files  # the shipped digits, not a download
