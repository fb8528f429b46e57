"""One exit-status contract, and every launch recipe acting on it as documented.

`trainkit/run/exit_codes.py` defines the statuses (2 configuration error, 74 a checkpoint not
written, 75 lost node, 130 Ctrl-C, 143 preempted) and docs/failures.md's "How a run ends" table repeats them:
both are parsed and compared. Then each recipe's decision is run, not read: the POD Job's
podFailurePolicy evaluated the way the Job controller does for pods ending with each status; the
sbatch script run by bash with an srun that ends with each status and an scontrol that records what
it was asked (and, on a requeue, ends the job as Slurm does); the torchrun scripts and the Swarm stack
through the kit's wrapper that keeps the workers' status (its own tests run it with workers ending with
each status).
"""

import ast
import importlib.util
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from .conftest import ANSWER_SETS
from .launch_runs import launch_environment, quick_cpu_run, write_fake_mnist

CONFIG_ERROR, CANNOT_WRITE, LOST_NODE, INTERRUPTED, PREEMPTED = 2, 74, 75, 130, 143
# A bug; a checkpoint the disk refused (a retry ends with 2 while it is full); SIGKILL (out of memory).
OTHER_FAILURES = (1, CANNOT_WRITE, 137)


def exit_codes_module(project: Path) -> Path:
    return project / "src" / "trainkit" / "run" / "exit_codes.py"


def constants(project: Path) -> dict[str, int]:
    """The module's names and values, as Python evaluates them (128 + signal.SIGINT, ...)."""
    spec = importlib.util.spec_from_file_location("generated_exit_codes", exit_codes_module(project))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {name: value for name, value in vars(module).items() if name.isupper() and isinstance(value, int)}


def markdown_table(lines: list[str]) -> dict[int, tuple[str, ...]]:
    """The rows of the first table whose header starts with `status`: {status: (other cells...)}."""
    rows: dict[int, tuple[str, ...]] = {}
    inside = False
    for line in lines:
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.strip().startswith("|"):
            if inside:
                break
            continue
        if cells[0] == "status":
            inside = True
        elif inside and cells[0].isdigit():
            rows[int(cells[0])] = tuple(cells[1:])
    return rows


def docstring_table(project: Path) -> dict[int, tuple[str, ...]]:
    docstring = ast.get_docstring(ast.parse(exit_codes_module(project).read_text()))
    return markdown_table(docstring.splitlines())


def readme_table(project: Path) -> dict[int, tuple[str, ...]]:
    readme = (project / "docs" / "failures.md").read_text()
    section = readme.split("\n## How a run ends", 1)[1].split("\n## ", 1)[0]
    return markdown_table(section.splitlines())


@pytest.mark.parametrize("answer_set", ANSWER_SETS)
def test_readme_and_exit_codes_module_state_one_contract(projects, answer_set):
    project = projects[answer_set]
    assert constants(project) == {
        "CONFIG_ERROR": CONFIG_ERROR,
        "CANNOT_WRITE": CANNOT_WRITE,
        "LOST_NODE": LOST_NODE,
        "INTERRUPTED": INTERRUPTED,
        "PREEMPTED": PREEMPTED,
    }
    documented = docstring_table(project)
    assert set(documented) == {0, 1, CONFIG_ERROR, CANNOT_WRITE, LOST_NODE, INTERRUPTED, PREEMPTED}
    assert readme_table(project) == documented
    assert "never retry" in documented[CONFIG_ERROR][1]
    assert all("retry" in documented[status][1] and "never" not in documented[status][1]
               for status in (LOST_NODE, PREEMPTED))  # fmt: skip
    for readme in (project / "launch").glob("*/README.md"):
        assert "How a run ends" in " ".join(readme.read_text().split()), f"{readme} does not point to the contract"


# ---- POD: the Job's podFailurePolicy ------------------------------------------------------------

ACTIONS = {"FailJob", "FailIndex", "Ignore", "Count"}


def job_of(project: Path) -> dict:
    documents = yaml.safe_load_all((project / "launch" / "pod" / "job.yaml").read_text())
    (job,) = [doc for doc in documents if doc and doc["kind"] == "Job"]
    return job


def check_policy_is_valid(job: dict) -> None:
    """What the API server checks of a podFailurePolicy beyond the schema kubernetes-validate knows."""
    pod_spec = job["spec"]["template"]["spec"]
    assert pod_spec["restartPolicy"] == "Never", "podFailurePolicy requires restartPolicy: Never"
    containers = {container["name"] for container in pod_spec["containers"]}
    for rule in job["spec"]["podFailurePolicy"]["rules"]:
        assert rule["action"] in ACTIONS
        assert ("onExitCodes" in rule) != ("onPodConditions" in rule), rule
        codes = rule.get("onExitCodes")
        if codes:
            values = codes["values"]
            assert values == sorted(set(values)), "exit codes must be ordered, without repeats"
            assert codes["operator"] in ("In", "NotIn") and 0 < len(values) <= 255
            assert codes["operator"] == "NotIn" or 0 not in values
            assert codes.get("containerName", next(iter(containers))) in containers


def pod_failure_action(job: dict, exit_code: int, conditions: tuple[str, ...] = ()) -> str:
    """The Job controller's decision for a failed pod: the first rule that matches, else Count."""
    for rule in job["spec"]["podFailurePolicy"]["rules"]:
        codes = rule.get("onExitCodes")
        # The pod has one container, so its exit code decides. In: listed; NotIn: not listed.
        if codes and (exit_code in codes["values"]) == (codes["operator"] == "In"):
            return rule["action"]
        for condition in rule.get("onPodConditions", []):
            if condition["type"] in conditions and condition.get("status", "True") == "True":
                return rule["action"]
    return "Count"


@pytest.mark.parametrize("answer_set", ANSWER_SETS)
def test_pod_failure_policy_follows_the_contract(projects, answer_set):
    job = job_of(projects[answer_set])
    check_policy_is_valid(job)
    expected = {CONFIG_ERROR: "FailJob", INTERRUPTED: "FailJob", LOST_NODE: "Ignore", PREEMPTED: "Ignore"}
    expected.update(dict.fromkeys(OTHER_FAILURES, "Count"))
    assert {code: pod_failure_action(job, code) for code in expected} == expected
    # A pod that Kubernetes evicted, preempted or drained is retried without counting, whatever its status.
    disrupted = {code: pod_failure_action(job, code, ("DisruptionTarget",)) for code in expected}
    assert set(disrupted.values()) == {"Ignore"}, disrupted
    assert job["spec"]["backoffLimit"] >= 1


# ---- Slurm: the sbatch script's requeue decision, run by bash ---------------------------------

FAKE_SRUN = """\
#!/bin/bash
# Stands in for srun: the tasks end with FAKE_STATUS after FAKE_SECONDS, or on SIGTERM save a
# checkpoint (half a second here) and end with 143.
echo "srun $*" >> "${FAKE_LOG}"
trap 'sleep 0.5; exit 143' TERM
sleep "${FAKE_SECONDS:-0}" &
wait $!
exit "${FAKE_STATUS:-0}"
"""
FAKE_SCONTROL = """\
#!/bin/bash
# Stands in for scontrol: records its arguments. A requeue ends the running job as Slurm does:
# SIGTERM to every process of the batch step, the script and srun (their process group here).
echo "scontrol $*" >> "${FAKE_LOG}"
if [[ $1 == requeue ]]; then
    trap '' TERM
    kill -TERM 0
fi
"""
JOB_ID = "4242"


def fake_slurm(tmp_path: Path) -> tuple[Path, Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir, tmp_path / "calls.log"


def start_batch_script(project: Path, tmp_path: Path, cwd: Path | None = None, **variables: str) -> subprocess.Popen:
    """The generated sbatch script as Slurm runs it: bash, in the submit directory, with SLURM_*."""
    bin_dir, calls = fake_slurm(tmp_path)
    env = {name: value for name, value in os.environ.items() if name != "MAX_REQUEUES"}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", FAKE_LOG=str(calls), SLURM_JOB_ID=JOB_ID,
               SLURM_RESTART_COUNT="0", SLURM_JOB_NUM_NODES="1", SLURM_NTASKS_PER_NODE="2",
               SLURM_JOB_NODELIST="n1")  # fmt: skip
    env.update(variables)
    return subprocess.Popen(
        ["bash", str(project / "launch" / "slurm" / "train.sbatch"), "--trainer.max_epochs", "1"],
        cwd=cwd or project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, like a batch step
    )


def finish(script: subprocess.Popen, tmp_path: Path) -> tuple[int, list[str], str]:
    """Exit status, the fake commands' calls (srun's arguments left out), and the script's output."""
    output, _ = script.communicate(timeout=60)
    log = tmp_path / "calls.log"
    calls = log.read_text().splitlines() if log.exists() else []
    return script.returncode, [call if not call.startswith("srun") else "srun" for call in calls], output


def wait_for_srun(tmp_path: Path) -> None:
    deadline = time.monotonic() + 30
    while not ((tmp_path / "calls.log").exists() and "srun" in (tmp_path / "calls.log").read_text()):
        assert time.monotonic() < deadline, "the script never started srun"
        time.sleep(0.05)
    time.sleep(0.2)  # srun has installed its trap


REQUEUE = f"scontrol requeue {JOB_ID}"


@pytest.mark.parametrize(
    ("tasks_status", "requeued"),
    [(0, False), (CONFIG_ERROR, False), (LOST_NODE, True), (INTERRUPTED, False), (PREEMPTED, True),
     *((status, False) for status in OTHER_FAILURES)],
)  # fmt: skip
def test_sbatch_requeues_on_lost_node_and_preemption_only(default_project, tmp_path, tasks_status, requeued):
    script = start_batch_script(default_project, tmp_path, FAKE_STATUS=str(tasks_status))
    code, calls, output = finish(script, tmp_path)
    assert code == tasks_status, output
    assert calls == (["srun", REQUEUE] if requeued else ["srun"]), output
    assert (f"job {JOB_ID}: tasks ended with status {tasks_status}, requeueing" in output) == requeued, output


def test_sbatch_requeues_a_bounded_number_of_times(default_project, tmp_path):
    script = start_batch_script(default_project, tmp_path, FAKE_STATUS=str(LOST_NODE), SLURM_RESTART_COUNT="10")
    code, calls, output = finish(script, tmp_path)
    assert (code, calls) == (LOST_NODE, ["srun"]), output
    assert "not requeued, it has been requeued 10 times (MAX_REQUEUES=10)" in output

    again = tmp_path / "raised"
    again.mkdir()
    script = start_batch_script(default_project, again, FAKE_STATUS=str(LOST_NODE), SLURM_RESTART_COUNT="10",
                                MAX_REQUEUES="11")  # fmt: skip
    code, calls, output = finish(script, again)
    assert (code, calls) == (LOST_NODE, ["srun", REQUEUE]), output


def test_sbatch_time_limit_requeues_once(default_project, tmp_path):
    """`--signal=B:USR1@90`: the script requeues, Slurm's SIGTERM stops the tasks (143): no second requeue."""
    script = start_batch_script(default_project, tmp_path, FAKE_SECONDS="30")
    wait_for_srun(tmp_path)
    script.send_signal(signal.SIGUSR1)
    code, calls, output = finish(script, tmp_path)
    assert (code, calls) == (PREEMPTED, ["srun", REQUEUE]), output
    assert f"job {JOB_ID}: time limit near, requeueing" in output


def test_sbatch_leaves_a_job_slurm_ends_to_slurm(default_project, tmp_path):
    """scancel, the time limit itself, Slurm's own preemption: SIGTERM to the script and the tasks alike."""
    script = start_batch_script(default_project, tmp_path, FAKE_SECONDS="30")
    wait_for_srun(tmp_path)
    os.killpg(script.pid, signal.SIGTERM)
    code, calls, output = finish(script, tmp_path)
    assert (code, calls) == (PREEMPTED, ["srun"]), output


def test_sbatch_outside_the_project_root_is_a_configuration_error(default_project, tmp_path):
    script = start_batch_script(default_project, tmp_path, cwd=tmp_path)
    code, calls, output = finish(script, tmp_path)
    assert (code, calls) == (CONFIG_ERROR, []), output
    assert output.startswith("error: submit from the project root")


# ---- torchrun, and Swarm on top of it --------------------------------------------------------

# The kit's torchrun wrapper, tested with workers ending with each status in trainkit/tests/test_torchrun_status.py.
SWARM_TORCHRUN = ["python", "-m", "trainkit.cluster.torchrun", "--swarm"]


def test_torchrun_script_ends_a_configuration_error_with_2(default_project, tmp_path):
    """The real training under launch/torchrun/single_node.sh: a bad option is a 2, not torchrun's 1."""
    data = write_fake_mnist(default_project, tmp_path / "mnist")
    result = subprocess.run(
        ["bash", str(default_project / "launch" / "torchrun" / "single_node.sh"),
         *quick_cpu_run(data, tmp_path / "out"), "--trainer.max_epochs", "many"],
        cwd=tmp_path, env=launch_environment(default_project, NPROC_PER_NODE="2"),
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert result.returncode == CONFIG_ERROR, result.stderr[-4000:]
    assert re.search(r"torchrun: workers ended with \{0: 2, 1: (2|143)\}", result.stderr), result.stderr[-4000:]


@pytest.mark.parametrize("answer_set", ANSWER_SETS)
def test_swarm_services_restart_only_what_a_retry_can_fix(projects, answer_set):
    """Swarm restarts on any non-zero status: each service runs torchrun through the wrapper's --swarm."""
    project = projects[answer_set]
    stack = yaml.safe_load((project / "launch" / "swarm" / "compose.yaml").read_text())
    assert (project / "src" / "trainkit" / "cluster" / "torchrun.py").is_file()
    for name, service in stack["services"].items():
        assert service["command"][: len(SWARM_TORCHRUN)] == SWARM_TORCHRUN, name
        assert service["deploy"]["restart_policy"]["condition"] == "on-failure", name
        # torchrun must not kill the workers before the grace period is over: they save a checkpoint.
        grace = service["stop_grace_period"]
        seconds = int(grace[:-1]) * {"s": 1, "m": 60}[grace[-1]]
        assert 60 <= int(service["environment"]["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) < seconds, name
