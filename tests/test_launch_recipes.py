"""The launch recipes of every generated project pass real validators and say what they mean.

Validators, pinned in requirements-test.txt and offline: hadolint (Dockerfile), shellcheck (shell
scripts, the sbatch script), yamllint (every YAML file, with the project's .yamllint.yaml),
kubernetes-validate --strict (Kubernetes manifests) and check-jsonschema with the Compose spec
(the Swarm stack). Each one is also shown to reject a copy of our file with one realistic
mistake, so a pass means something.

Beyond syntax, the Kubernetes manifests are evaluated as Kubernetes creates the pods and the
variables each pod gets go through the project's own platform detection; the Swarm stack is
checked service by service; the Dockerfile for what every platform relies on; and the torchrun
scripts really train, two nodes on CPU.
"""

import importlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import yaml
from cookiecutter.generate import generate_context
from cookiecutter.prompt import prompt_for_config

from .conftest import ANSWER_SETS, TEMPLATE
from .launch_runs import TRAIN_STEPS, assert_one_process_group, launch_environment, quick_cpu_run, write_fake_mnist
from .slurm_cluster import free_port

ENTRY_COMMAND = ["python", "train.py", "fit", "--config", "configs/experiment.yaml"]
SHELL_SHEBANG = re.compile(r"#!\s*/(usr/)?bin/(env\s+)?(ba)?sh\b")


def answers(answer_set: str) -> dict[str, str]:
    """The answers a project was generated with, rendered by cookiecutter as for generation."""
    context = generate_context(context_file=TEMPLATE / "cookiecutter.json", extra_context=ANSWER_SETS[answer_set])
    return dict(prompt_for_config(context, no_input=True))


# ---- the validators -------------------------------------------------------------------------


def tool(name: str) -> str:
    """A validator from this environment (pip puts it beside the interpreter) or from PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    assert found, f"{name} is missing: pip install -r requirements-test.txt"
    return found


def dockerfiles(project: Path) -> list[Path]:
    return sorted(path for path in project.rglob("*") if path.name == "Dockerfile" or path.suffix == ".dockerfile")


def shell_scripts(project: Path) -> list[Path]:
    """Files named like shell scripts or starting with a sh/bash shebang."""
    scripts = []
    for path in sorted(project.rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        if path.suffix in (".sh", ".bash", ".sbatch"):
            scripts.append(path)
        elif path.suffix in ("", ".slurm", ".run"):
            with path.open("rb") as file:
                if SHELL_SHEBANG.match(file.readline().decode(errors="replace")):
                    scripts.append(path)
    return scripts


def kubernetes_manifests(project: Path) -> list[Path]:
    return sorted((project / "launch" / "pod").glob("*.yaml"))


def compose_files(project: Path) -> list[Path]:
    return sorted((project / "launch" / "swarm").glob("*compose*.yaml"))


def run(command: list, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(part) for part in command], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def hadolint(project: Path) -> subprocess.CompletedProcess:
    # Strictest threshold: style findings fail too.
    return run([tool("hadolint"), "--failure-threshold", "style", *dockerfiles(project)], project)


def shellcheck(project: Path) -> subprocess.CompletedProcess:
    return run([tool("shellcheck"), *shell_scripts(project)], project)


def yamllint(project: Path) -> subprocess.CompletedProcess:
    # Every file yamllint takes for YAML, with the project's own .yamllint.yaml; warnings fail too.
    return run([tool("yamllint"), "--strict", "."], project)


def kubernetes_validate(project: Path) -> subprocess.CompletedProcess:
    return run([tool("kubernetes-validate"), "--strict", *kubernetes_manifests(project)], project)


def compose_schema(project: Path) -> subprocess.CompletedProcess:
    return run([tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", *compose_files(project)], project)


VALIDATORS = {
    "hadolint": hadolint,
    "shellcheck": shellcheck,
    "yamllint": yamllint,
    "kubernetes-validate": kubernetes_validate,
    "check-jsonschema": compose_schema,
}

TORCHRUN_SCRIPTS = ["launch/torchrun/multi_node.sh", "launch/torchrun/single_node.sh"]

# What each validator must be given, at least, in every project.
EXPECTED_INPUTS = {
    "hadolint": (dockerfiles, ["Dockerfile"]),
    "shellcheck": (shell_scripts, ["launch/slurm/train.sbatch", *TORCHRUN_SCRIPTS]),
    "yamllint": (lambda project: sorted(project.rglob("*.yaml")), ["launch/pod/job.yaml", "launch/swarm/compose.yaml"]),
    "kubernetes-validate": (kubernetes_manifests, ["launch/pod/job.yaml"]),
    "check-jsonschema": (compose_files, ["launch/swarm/compose.yaml"]),
}


@pytest.mark.parametrize("answer_set", ANSWER_SETS)
@pytest.mark.parametrize("validator", VALIDATORS)
def test_recipes_pass_the_validator(projects, answer_set, validator):
    project = projects[answer_set]
    find, expected = EXPECTED_INPUTS[validator]
    inputs = {path.relative_to(project).as_posix() for path in find(project)}
    assert set(expected) <= inputs, f"{validator} would not see {set(expected) - inputs}"
    result = VALIDATORS[validator](project)
    assert result.returncode == 0, f"{validator} failed:\n{result.stdout}{result.stderr}"


# One realistic mistake per validator: (file, text, replacement, what the validator must report).
BREAKAGES = {
    # An unpinned package
    "hadolint": ("Dockerfile", "pip install --no-cache-dir --no-deps .", "pip install torch", "DL3013"),
    "shellcheck": ("launch/slurm/train.sbatch", '"$@"', "$@", "SC2068"),  # arguments re-split
    "yamllint": (
        "launch/pod/job.yaml",
        "restartPolicy: Never",
        "restartPolicy: Never\n" + 6 * " " + "restartPolicy: Never",
        "key-duplicates",
    ),
    "kubernetes-validate": ("launch/pod/job.yaml", "GracePeriodSeconds:", "GracePeriodSecond:", "GracePeriodSecond"),
    "check-jsonschema": ("launch/swarm/compose.yaml", "placement:", "placment:", "placment"),
}


@pytest.mark.parametrize("validator", VALIDATORS)
def test_validator_rejects_a_broken_recipe(default_project, tmp_path, validator):
    project = Path(shutil.copytree(default_project, tmp_path / "project"))
    name, text, replacement, complaint = BREAKAGES[validator]
    path = project / name
    assert text in path.read_text(), f"{name} no longer contains {text!r}: update the breakage"
    path.write_text(path.read_text().replace(text, replacement, 1))
    result = VALIDATORS[validator](project)
    assert result.returncode != 0, f"{validator} accepted a broken {name}:\n{result.stdout}{result.stderr}"
    assert complaint in result.stdout + result.stderr


# ---- Kubernetes: the pods as Kubernetes would create them -------------------------------------

CLUSTER_DOMAIN = "cluster.local"
DOCUMENTED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "JOB_NAME", "SVC_NAME", "POD_NAMESPACE")
INDEX_KEY = "batch.kubernetes.io/job-completion-index"
FIELD_PATH = re.compile(r"metadata\.(labels|annotations)\['([^']+)'\]")
VARIABLE_REFERENCE = re.compile(r"\$\$|\$\(([-._a-zA-Z][-._a-zA-Z0-9]*)\)")


def expand(value: str, defined: dict[str, str]) -> str:
    """Kubernetes' $(NAME) expansion: variables defined earlier; `$$` is a literal `$`; others stay."""

    def replace(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        return defined.get(match.group(1), match.group(0))

    return VARIABLE_REFERENCE.sub(replace, value)


def field(pod: dict, path: str) -> str:
    """The downward API's fieldRef, for the pod metadata a Job's pod has."""
    if path in ("metadata.name", "metadata.namespace", "metadata.uid"):
        return pod["metadata"][path.split(".")[1]]
    match = FIELD_PATH.fullmatch(path)
    if match:
        return pod["metadata"][match.group(1)].get(match.group(2), "")
    raise AssertionError(f"fieldRef {path} is not modelled by this test")


def container_env(pod: dict, container: dict) -> dict[str, str]:
    """The environment Kubernetes gives the container, in order, as the kubelet resolves it."""
    env: dict[str, str] = {}
    for variable in container.get("env", []):
        name, source = variable["name"], variable.get("valueFrom")
        if source is None:
            env[name] = expand(str(variable.get("value", "")), env)
        elif "fieldRef" in source:
            env[name] = field(pod, source["fieldRef"]["fieldPath"])
        elif "secretKeyRef" in source or "configMapKeyRef" in source:
            reference = source.get("secretKeyRef") or source.get("configMapKeyRef")
            assert reference.get("optional"), f"{name} needs a {reference['name']} object the user may not have"
        else:
            raise AssertionError(f"{name}: valueFrom {source} is not modelled by this test")
    return env


def job_pods(documents: list[dict], namespace: str) -> list[dict]:
    """The pods an Indexed Job creates: metadata, host name, DNS name and the container's environment."""
    (job,) = [doc for doc in documents if doc["kind"] == "Job"]
    spec, template = job["spec"], job["spec"]["template"]
    assert spec["completionMode"] == "Indexed"
    assert spec["parallelism"] == spec["completions"], "every pod of a training job must run at once"
    name = job["metadata"]["name"]
    services = {doc["metadata"]["name"]: doc for doc in documents if doc["kind"] == "Service"}
    pods = []
    for index in range(spec["completions"]):
        labels = {**template.get("metadata", {}).get("labels", {}), "job-name": name,
                  "batch.kubernetes.io/job-name": name, INDEX_KEY: str(index)}  # fmt: skip
        annotations = {**template.get("metadata", {}).get("annotations", {}), INDEX_KEY: str(index)}
        pod = {"metadata": {"name": f"{name}-{index}-x7k2p", "namespace": namespace, "uid": f"uid-{index}",
                            "labels": labels, "annotations": annotations}}  # fmt: skip
        # An Indexed Job names each pod's host <job>-<index>; with a subdomain served by a headless
        # Service that selects the pod, DNS has <host>.<subdomain>.<namespace>.svc.<domain>.
        pod["hostname"] = f"{name}-{index}"
        service = services.get(template["spec"].get("subdomain"))
        selects = service is not None and all(labels.get(k) == v for k, v in service["spec"]["selector"].items())
        pod["fqdn"] = (
            f"{pod['hostname']}.{service['metadata']['name']}.{namespace}.svc.{CLUSTER_DOMAIN}"
            if selects and service["spec"].get("clusterIP") == "None"
            else None
        )
        (container,) = template["spec"]["containers"]
        pod["env"] = container_env(pod, container)
        # The Job controller adds this one after the container's own variables.
        pod["env"].setdefault("JOB_COMPLETION_INDEX", str(index))
        pods.append(pod)
    return pods


@pytest.fixture(scope="module")
def pod_project(cookies_session) -> Path:
    """A project for the documents' example: job `test`, 2 nodes."""
    result = cookies_session.bake(extra_context={"project_name": "Pod Check", "job_name": "test", "num_nodes": "2"})
    assert result.exit_code == 0, result.exception
    return result.project_path


def load_manifests(project: Path) -> list[dict]:
    documents = []
    for path in kubernetes_manifests(project):
        documents += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return documents


def project_cluster_module(project: Path, package: str):
    sys.path.insert(0, str(project / "src"))
    try:
        return importlib.import_module("trainkit.cluster.platforms")
    finally:
        sys.path.remove(str(project / "src"))


def test_pods_get_the_documented_variables_and_host_names(pod_project):
    pods = job_pods(load_manifests(pod_project), namespace="demo-project")
    assert len(pods) == 2
    main = "test-0.test-service.demo-project.svc.cluster.local"
    for index, pod in enumerate(pods):
        assert pod["hostname"] == f"test-{index}"
        assert pod["fqdn"] == f"test-{index}.test-service.demo-project.svc.cluster.local"
        assert {name: pod["env"].get(name) for name in DOCUMENTED} == {
            "RANK": str(index),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": main,
            "MASTER_PORT": "29500",
            "JOB_NAME": "test",
            "SVC_NAME": "test-service",
            "POD_NAMESPACE": "demo-project",
        }
        # Variables of other launchers would make the project take the pod for another platform.
        foreign = [name for name in pod["env"] if name in ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK")
                   or name.startswith(("SLURM_", "SING_", "TORCHELASTIC_", "PET_"))]  # fmt: skip
        assert not foreign


@pytest.mark.filterwarnings("ignore:The `srun` command is available")  # Lightning, on this machine with Slurm
def test_the_project_reads_each_pod_as_its_node(pod_project):
    """Each pod's variables, given to the project's own detection, place it as the documents say."""
    cluster = project_cluster_module(pod_project, "pod_check")
    pods = job_pods(load_manifests(pod_project), namespace="demo-project")
    for index, pod in enumerate(pods):
        with mock.patch.dict(os.environ, pod["env"], clear=True):
            platform = cluster.detect_platform()
            environment = platform.environment
            assert (platform.name, platform.num_nodes) == ("POD", len(pods))
            assert environment.node_rank() == index
            assert not environment.creates_processes_externally  # Lightning starts the pod's other GPUs
            assert (environment.main_address, environment.main_port) == (pods[0]["fqdn"], 29500)
            assert [environment.host(rank) for rank in range(len(pods))] == [other["fqdn"] for other in pods]


@pytest.mark.parametrize("answer_set", ANSWER_SETS)
def test_kubernetes_job_matches_the_answers(projects, answer_set):
    project, chosen = projects[answer_set], answers(answer_set)
    documents = load_manifests(project)
    assert all("namespace" not in doc["metadata"] for doc in documents), "kubectl apply -n picks the namespace"
    (service,) = [doc for doc in documents if doc["kind"] == "Service"]
    assert service["spec"]["publishNotReadyAddresses"] is True, "pods must resolve each other while starting"
    (job,) = [doc for doc in documents if doc["kind"] == "Job"]
    pod_spec = job["spec"]["template"]["spec"]
    (container,) = pod_spec["containers"]
    nodes, port = int(chosen["num_nodes"]), int(chosen["main_port"])
    pods = job_pods(documents, namespace="ns")
    assert len(pods) == nodes
    job_name = chosen["job_name"]
    for index, pod in enumerate(pods):
        assert pod["fqdn"] == f"{job_name}-{index}.{job_name}-service.ns.svc.cluster.local"
        assert pod["env"]["RANK"] == str(index) and pod["env"]["WORLD_SIZE"] == str(nodes)
        assert pod["env"]["MASTER_ADDR"] == pods[0]["fqdn"] and pod["env"]["MASTER_PORT"] == str(port)
    assert container["image"] == chosen["docker_image"]
    assert container["command"] == ENTRY_COMMAND
    assert container["resources"]["limits"]["nvidia.com/gpu"] == int(chosen["gpus_per_node"])
    assert port in [entry["containerPort"] for entry in container["ports"]]
    volumes = {volume["name"]: volume for volume in pod_spec["volumes"]}
    shm = [mount["name"] for mount in container["volumeMounts"] if mount["mountPath"] == "/dev/shm"]
    assert shm and volumes[shm[0]]["emptyDir"]["medium"] == "Memory"
    assert pod_spec["terminationGracePeriodSeconds"] >= 120, "SIGTERM must leave time for a checkpoint"


# ---- Docker Swarm ---------------------------------------------------------------------------


# Swarm runs torchrun through the kit's wrapper that keeps the training's exit status (tests/test_exit_contract.py).
SWARM_TORCHRUN = ["python", "-m", "trainkit.cluster.torchrun", "--swarm"]


def torchrun_options(command: list[str]) -> tuple[dict[str, str], list[str]]:
    """torchrun's `--name value` options, and the script command after them."""
    assert command[: len(SWARM_TORCHRUN)] == SWARM_TORCHRUN
    options, rest = {}, command[len(SWARM_TORCHRUN) :]
    while rest and rest[0].startswith("--"):
        name, _, value = rest[0].partition("=")
        options[name], rest = (value, rest[1:]) if value else (rest[1], rest[2:])
    return options, rest


@pytest.mark.parametrize("answer_set", ANSWER_SETS)
def test_swarm_stack_runs_one_torchrun_node_per_service(projects, answer_set):
    chosen = answers(answer_set)
    (compose_file,) = compose_files(projects[answer_set])
    stack = yaml.safe_load(compose_file.read_text())
    services = list(stack["services"].items())
    nodes = int(chosen["num_nodes"])
    assert len(services) == nodes, "one service per node"
    main_service = services[0][0]
    constraints = set()
    for rank, (name, service) in enumerate(services):
        options, script = torchrun_options(service["command"])
        assert options == {
            "--nnodes": str(nodes),
            "--nproc-per-node": "gpu",
            "--node-rank": str(rank),
            "--master-addr": main_service,
            "--master-port": chosen["main_port"],
        }, name
        assert script == ENTRY_COMMAND[1:], name
        assert service["image"] == chosen["docker_image"]
        deploy = service["deploy"]
        (constraint,) = deploy["placement"]["constraints"]
        constraints.add(constraint)
        (gpus,) = deploy["resources"]["reservations"]["generic_resources"]
        assert gpus["discrete_resource_spec"] == {"kind": "gpu", "value": int(chosen["gpus_per_node"])}
        tmpfs = [volume for volume in service["volumes"] if isinstance(volume, dict) and volume["type"] == "tmpfs"]
        assert [volume["target"] for volume in tmpfs] == ["/dev/shm"]
        assert set(service["networks"]) == set(stack["networks"])
    assert len(constraints) == nodes, "each service must be placed on its own node"
    for network in stack["networks"].values():
        assert network == {"driver": "overlay", "attachable": True}


# ---- Dockerfile -----------------------------------------------------------------------------


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in dockerfile.read_text().splitlines()
                                           if not line.lstrip().startswith("#")))  # fmt: skip
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize("answer_set", ANSWER_SETS)
def test_dockerfile_builds_one_image_for_every_platform(projects, answer_set):
    project, chosen = projects[answer_set], answers(answer_set)
    steps = instructions(project / "Dockerfile")
    arguments = dict(args.split("=", 1) for kind, args in steps if kind == "ARG" and "=" in args)
    assert arguments["BASE_IMAGE"] == chosen["docker_base_image"]
    assert [args for kind, args in steps if kind == "FROM"] == ["${BASE_IMAGE}"]
    assert json.loads(next(args for kind, args in reversed(steps) if kind == "CMD")) == ENTRY_COMMAND
    user = next(args for kind, args in reversed(steps) if kind == "USER")
    assert user.split(":")[0] not in ("root", "0") and arguments.get(user.strip("${}"), user) not in ("root", "0")
    assert chosen["main_port"] in [args for kind, args in steps if kind == "EXPOSE"]
    # A compiler for torch.compile only on request (--build-arg COMPILER=1): the kit refuses compiled models without.
    assert arguments["COMPILER"] == "0"
    (compiler,) = [args for kind, args in steps if kind == "RUN" and "${COMPILER}" in args]
    assert "apt-get install -y --no-install-recommends gcc g++ libc6-dev" in compiler
    ignored = set((project / ".dockerignore").read_text().split())
    assert {".git", ".venv", "data", "runs", "wandb", ".netrc"} <= ignored


# ---- NCCL and gloo: their own choices, but where a recipe must name the network -----------------

NETWORK_VARIABLE = re.compile(r"\b(?:NCCL|GLOO)_[A-Z0-9_]+\b")


def network_variables(variables: dict[str, str]) -> dict[str, str]:
    return {name: value for name, value in variables.items() if NETWORK_VARIABLE.fullmatch(name)}


def declared_in_dockerfile(dockerfile: Path) -> dict[str, str]:
    """Every ENV and ARG of the Dockerfile, NAME -> value ("" for an ARG without a default)."""
    declared = {}
    for kind, args in instructions(dockerfile):
        if kind in ("ENV", "ARG"):
            declared.update(word.partition("=")[::2] for word in shlex.split(args))
    return declared


def named_in_code(path: Path) -> dict[str, str]:
    """NCCL_* and GLOO_* named outside comments in a script: set, exported or passed on, it counts."""
    code = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
    return {name: "(in the code)" for name in NETWORK_VARIABLE.findall(code)}


def named_in_readme(readme: Path) -> dict[str, str]:
    """NCCL_* and GLOO_* that a launch README has the reader set: in its commands and its settings table."""
    commands = "\n".join(re.findall(r"```bash\n(.*?)```", readme.read_text(), re.DOTALL))
    settings = "\n".join(line for line in readme.read_text().splitlines() if line.startswith("| Environment"))
    return {name: "(in the README)" for name in NETWORK_VARIABLE.findall(commands + settings)}


def network_settings(project: Path) -> dict[str, dict[str, str]]:
    """The NCCL_* and GLOO_* variables the image and each launch recipe set, by where they are set."""
    settings = {"Dockerfile": network_variables(declared_in_dockerfile(project / "Dockerfile"))}
    for pod in job_pods(load_manifests(project), namespace="ns"):
        settings[f"launch/pod/job.yaml, pod {pod['hostname']}"] = network_variables(pod["env"])
    for compose_file in compose_files(project):
        for name, service in yaml.safe_load(compose_file.read_text())["services"].items():
            where = f"{compose_file.relative_to(project).as_posix()}, service {name}"
            settings[where] = network_variables(service.get("environment", {}))
    for script in [*shell_scripts(project / "launch"), *sorted((project / "launch").rglob("*.py"))]:
        settings[script.relative_to(project).as_posix()] = named_in_code(script)
    for readme in sorted((project / "launch").glob("*/README.md")):
        settings[readme.relative_to(project).as_posix()] = named_in_readme(readme)
    return settings


@pytest.mark.parametrize("answer_set", ANSWER_SETS)
def test_nccl_and_gloo_are_set_only_where_the_network_must_be_named(projects, answer_set):
    """The image overrides neither NCCL's choice nor a site's /etc/nccl.conf. Swarm's overlay is named, and for
    gloo as for NCCL (gloo would bind to another interface); InfiniBand is off there, as no service gets its devices."""
    settings = network_settings(projects[answer_set])
    read = {where.partition(",")[0] for where in settings}
    assert {"Dockerfile", "launch/pod/job.yaml", "launch/swarm/compose.yaml", "launch/slurm/train.sbatch",
            *TORCHRUN_SCRIPTS, "launch/sing/README.md"} <= read  # fmt: skip
    swarm = {where: variables for where, variables in settings.items() if where.startswith("launch/swarm/compose")}
    assert len(swarm) == int(answers(answer_set)["num_nodes"])
    for where, variables in swarm.items():
        interface = variables.get("NCCL_SOCKET_IFNAME")
        assert interface, where
        assert variables == {"NCCL_SOCKET_IFNAME": interface, "GLOO_SOCKET_IFNAME": interface, "NCCL_IB_DISABLE": "1"}
    others = {where: variables for where, variables in settings.items() if where not in swarm and variables}
    assert others == {}


# ---- torchrun: the scripts really train -------------------------------------------------------


def test_torchrun_scripts_train_on_cpu(default_project, tmp_path):
    """single_node.sh with 2 processes and multi_node.sh on 2 nodes x 1 process, all at once, over gloo."""
    data = write_fake_mnist(default_project, tmp_path / "mnist")
    port = str(free_port())
    multi_node = {"NNODES": "2", "NPROC_PER_NODE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                  "RDZV_ID": f"test-{port}"}  # fmt: skip
    runs = {
        "single": ("single_node.sh", [{"NPROC_PER_NODE": "2"}], 2),  # script, nodes, processes per node
        "multi": ("multi_node.sh", [multi_node] * 2, 1),
    }
    started = []
    for name, (script, nodes, _) in runs.items():
        for node, variables in enumerate(nodes):
            log = tmp_path / f"{name}-{node}.log"
            command = ["bash", default_project / "launch" / "torchrun" / script, *quick_cpu_run(data, tmp_path / name)]
            with log.open("w") as output:  # the node writes its own copy
                process = subprocess.Popen(
                    [str(part) for part in command],
                    cwd=tmp_path,  # the scripts find the project root themselves
                    env=launch_environment(default_project, **variables),
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            started.append((process, log))
    try:
        for process, log in started:
            code = process.wait(timeout=240)
            assert code == 0, f"{shlex.join(process.args)} ended with {code}:\n{log.read_text()[-4000:]}"
    finally:
        for process, _ in started:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    for name, (_, _, per_node) in runs.items():
        log = (tmp_path / f"{name}-0.log").read_text()
        reports = assert_one_process_group(tmp_path / name, world=2, processes_per_node=per_node, log=log)
        assert reports[0]["global_step"] == TRAIN_STEPS
        assert "[torchrun]" in log
