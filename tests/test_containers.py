"""The generated image, built from the project's own Dockerfile, runs every container platform for real.

podman builds the Dockerfile unchanged on a CPU stand-in for the CUDA PyTorch base image
(containers.py) and runs it the way the platforms do: one container per node, on a network
whose DNS answers the platforms' documented host names, each container with only its
platform's variables and the image's own command (plus the overrides a CPU needs), the runs on
a shared volume. Preemption is `podman stop` (SIGTERM to PID 1, then SIGKILL), a lost node is
`podman kill`. Docker Swarm is a real dockerd and `docker stack deploy` of the generated
compose file. A run passes only if all 4 processes formed one job and ended with the same weights.
The sharded strategy writes one checkpoint directory on the shared volume, and refuses nodes that do not share one.
"""

import itertools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
import torch
import yaml

from .containers import (
    IMAGE_USER_ID,
    IMAGES,
    PACKAGES,
    PROGRAMS,
    Containers,
    build,
    ensure_programs,
    image_command,
    image_user,
    podman,
    rebuild,
    shared_volume,
    torch_base_image,
    wait_for_file,
)
from .docker_swarm import DEBIAN_CLI, DockerSwarm
from .host import root_or_skip
from .launch_runs import SHARDED, TRAIN_STEPS, assert_one_process_group, assert_one_sharded_job, quick_cpu_run

pytestmark = pytest.mark.containers

PROCESSES_PER_NODE = 2
NODES = 2
# The documents' example job `test`: node i's host is test-<i>.<suffix>.
HOST_SUFFIX = "test-service.demo-project.svc.cluster.local"
RUNS = Path("/workspace/runs")  # the shared volume, where the image's runs/ is
DATA = Path("/data")


def host(rank: int) -> str:
    return f"test-{rank}.{HOST_SUFFIX}"


PLATFORM_VARIABLES = {
    "SING": lambda rank: {"SING_RANK": str(rank), "SING_WORLD_SIZE": str(NODES), "SING_JOB_NAME": "test",
                          "SING_HOSTNAME_SUFFIX": HOST_SUFFIX, "SING_MASTER_ADDR": host(0)},
    "POD": lambda rank: {"RANK": str(rank), "WORLD_SIZE": str(NODES), "JOB_NAME": "test", "SVC_NAME": "test-service",
                         "POD_NAMESPACE": "demo-project", "MASTER_ADDR": host(0)},
}  # fmt: skip


@pytest.fixture(scope="module")
def project_image(default_project):
    """The default project's image, built from its own Dockerfile on the CPU base."""
    root_or_skip("building and running containers")
    ensure_programs(PROGRAMS, PACKAGES)
    tag = f"{IMAGES}/project:test"
    rebuild(default_project, tag, {"BASE_IMAGE": torch_base_image()})
    return tag


TEST_NUMBERS = itertools.count()


@pytest.fixture
def containers():
    started = Containers(f"lmt{os.getpid()}-{next(TEST_NUMBERS)}")
    yield started
    started.close()


@pytest.fixture
def runs(tmp_path) -> Path:
    return shared_volume(tmp_path / "runs")


@pytest.fixture(scope="module")
def mnist(real_mnist, tmp_path_factory) -> Path:
    """The real digits, readable by the image's user (pytest's folders are its owner's only)."""
    data = Path(shutil.copytree(real_mnist, tmp_path_factory.mktemp("container-data") / "mnist"))
    for path in [data, *data.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return data


def start_node(containers: Containers, image: str, platform: str, rank: int, network: str, runs: Path,
               data: Path, *extra: str, env: dict[str, str] | None = None, runs_at: Path = RUNS,
               name: str = "") -> str:  # fmt: skip
    """One node as its platform starts it: its own container, its variables, the image's own command.

    `runs` is mounted at `runs_at`, where the runs and the rank reports go; `env` is added to the platform's variables.
    """
    # A job that cannot form, or loses a node, ends with its own line well within the test's wait for it.
    cpu = [*quick_cpu_run(DATA, runs_at), "--trainer.devices", str(PROCESSES_PER_NODE), "--cluster.timeout", "0:01:00",
           "--cluster.join_timeout", "0:02:00"]  # fmt: skip
    command = [*image_command(image), *cpu, *extra]
    return containers.run(
        name or f"{platform.lower()}-{rank}", image, command,
        network=network, hostname=f"test-{rank}", aliases=[host(rank)],
        env={**PLATFORM_VARIABLES[platform](rank), **(env or {})}, volumes=[f"{data}:{DATA}:ro", f"{runs}:{runs_at}"],
    )  # fmt: skip


def assert_finished(containers: Containers, nodes: list[str], timeout: float = 300) -> str:
    """Every node exited 0; node 0's log."""
    for node in nodes:
        code = containers.wait(node, timeout)
        assert code == 0, f"{node} exited {code}; this test's containers:\n{containers.report()}"
    return containers.logs(nodes[0])


def test_image_runs_as_its_own_user(project_image, default_project, containers):
    assert image_user(project_image) not in ("", "root", "0")
    command = ["python", "-m", "trainkit.cluster"]
    node = containers.run("cluster", project_image, command, network=containers.network("image"), hostname="test-0",
                          aliases=[], env={}, volumes=[])  # fmt: skip
    assert containers.wait(node, 60) == 0
    assert "platform=local" in containers.logs(node)


def build_steps(output: str) -> dict[str, str]:
    """`podman build`'s output by step: the instruction -> what the build printed for it."""
    steps = [step.partition("\n") for step in re.split(r"^STEP \d+/\d+: ", output, flags=re.MULTILINE)[1:]]
    return {instruction: printed for instruction, _, printed in steps}


def test_a_change_of_code_rebuilds_the_image_without_installing_the_dependencies_again(project_image, default_project,
                                                                                        tmp_path):  # fmt: skip
    """The dependency layer comes from pyproject.toml alone, so a commit that changes code leaves it cached."""
    project = Path(shutil.copytree(default_project, tmp_path / "project"))
    with (project / "train.py").open("a") as train:
        train.write("# a change of code\n")
    tag = f"{IMAGES}/project:changed-code"
    try:
        steps = build_steps(build(project, tag, {"BASE_IMAGE": torch_base_image()}))
    finally:
        podman("rmi", tag, check=False)
    (dependencies,) = [output for step, output in steps.items() if "pip install --no-cache-dir -r" in step]
    (own,) = [output for step, output in steps.items() if "pip install --no-cache-dir --no-deps ." in step]
    assert "Using cache" in dependencies, dependencies
    assert "Using cache" not in own and "Successfully installed" in own, own


@pytest.mark.parametrize("platform", ["SING", "POD"])
def test_two_containers_form_one_job_by_their_dns_names(platform, project_image, containers, runs, mnist):
    """SING: both nodes at once. POD: pod 0 starts 15 s late, so its name does not resolve at first."""
    network = containers.network(platform.lower())
    first, second = (1, 0) if platform == "POD" else (0, 1)
    nodes = {first: start_node(containers, project_image, platform, first, network, runs, mnist)}
    if platform == "POD":
        lookup = podman("exec", nodes[first], "getent", "hosts", host(0), check=False)
        assert lookup.returncode != 0, "pod 0's name resolved before pod 0 existed"
        time.sleep(15)
    nodes[second] = start_node(containers, project_image, platform, second, network, runs, mnist)

    log = assert_finished(containers, [nodes[0], nodes[1]])
    reports = assert_one_process_group(runs, NODES * PROCESSES_PER_NODE, PROCESSES_PER_NODE, log)
    assert reports[0]["global_step"] == TRAIN_STEPS
    assert f"[{platform}] node_rank=0 local_rank=0 global_rank=0 world_size=4 main={host(0)}:" in log
    # The image's user wrote the runs to the shared volume.
    assert {path.stat().st_uid for path in (runs / "reports").iterdir()} == {IMAGE_USER_ID}
    assert list((runs / "run" / "checkpoints").glob("*.ckpt"))


def test_podman_stop_preempts_and_the_same_containers_resume(project_image, containers, runs, mnist):
    network = containers.network("preempt")
    planned = 30
    paced = ["--trainer.limit_train_batches", "1.0", "--trainer.max_steps", str(planned),
             "--trainer.callbacks+=trainkit.testing.pacing.PaceSteps",
             "--trainer.callbacks.marker", str(RUNS / "step-3"), "--trainer.callbacks.at_step", "3"]  # fmt: skip
    nodes = [start_node(containers, project_image, "SING", rank, network, runs, mnist, *paced) for rank in (0, 1)]
    wait_for_file(runs / "step-3", lambda: True, lambda: containers.logs(nodes[0]))

    podman("stop", "--time", "60", *nodes, timeout=120)  # SIGTERM to PID 1, SIGKILL after 60 s
    codes = [containers.exit_code(node) for node in nodes]
    assert codes == [143, 143], containers.report()
    preempted = runs / "run" / "checkpoints" / "preempted.ckpt"
    stopped_at = torch.load(preempted, weights_only=True, map_location="cpu")["global_step"]
    assert 3 < stopped_at < planned

    podman("start", *nodes)
    log = assert_finished(containers, nodes)
    assert f"Restoring states from the checkpoint path at {RUNS / 'run' / 'checkpoints' / 'preempted.ckpt'}" in log
    reports = assert_one_process_group(runs, NODES * PROCESSES_PER_NODE, PROCESSES_PER_NODE, log)
    assert reports[0]["global_step"] == planned
    assert not preempted.exists()


BUCKET = "checkpoints"


def network_gateway(network: str) -> str:
    return podman("network", "inspect", "--format", "{{range .Subnets}}{{.Gateway}}{{end}}", network).stdout.strip()


@pytest.fixture
def bucket_network(project_image, containers, tmp_path) -> Iterator[tuple[str, dict[str, str]]]:
    """A network with moto's S3 server (a bucket `checkpoints`) on its gateway; the AWS_* variables that reach it.

    The server listens only on the gateway's address: the containers on this network and this host reach
    it, nothing else, and only while the test runs. The gateway's address exists while a container is
    attached to the network, so a container that sleeps holds it while the job's containers come and go.
    """
    network = containers.network("bucket")
    containers.run("holder", project_image, ["sleep", "infinity"], network=network, hostname="holder", aliases=[],
                   env={}, volumes=[])  # fmt: skip
    gateway = network_gateway(network)
    with socket.socket() as sock:
        sock.bind((gateway, 0))
        port = sock.getsockname()[1]
    log = tmp_path / "s3-server.log"
    command = [sys.executable, "-m", "moto.server", "-H", gateway, "-p", str(port)]
    with log.open("w") as output:  # the server writes its own copy
        server = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    try:
        aws = {"AWS_ACCESS_KEY_ID": "trainer", "AWS_SECRET_ACCESS_KEY": "secret", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_ENDPOINT_URL": f"http://{gateway}:{port}"}  # fmt: skip
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection((gateway, port), timeout=1).close()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)
        s3_client(aws).create_bucket(Bucket=BUCKET)
        yield network, aws
    finally:
        server.kill()
        server.wait()


def s3_client(aws: dict[str, str]):
    """An S3 client with the endpoint and credentials of the AWS_* variables `aws`."""
    return boto3.client("s3", endpoint_url=aws["AWS_ENDPOINT_URL"], region_name=aws["AWS_DEFAULT_REGION"],
                        aws_access_key_id=aws["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=aws["AWS_SECRET_ACCESS_KEY"])  # fmt: skip


def test_new_containers_with_no_run_volume_resume_from_the_bucket(project_image, containers, bucket_network, tmp_path,
                                                                  mnist):  # fmt: skip
    network, aws = bucket_network
    out = shared_volume(tmp_path / "out")  # the test's own output (rank reports, the marker), not the run
    out_at = Path("/test-output")
    on_disk = Path("/workspace/runs/experiment")  # the image's own place for the run: each container's disk
    planned = 20
    command = ["--trainer.default_root_dir", str(on_disk), "--checkpoint_store.url", f"s3://{BUCKET}/job",
               "--trainer.limit_train_batches", "1.0", "--trainer.max_steps", str(planned),
               "--trainer.callbacks+=trainkit.testing.pacing.PaceSteps",
               "--trainer.callbacks.marker", str(out_at / "step-3"), "--trainer.callbacks.at_step", "3"]  # fmt: skip

    def start(rank: int, name: str) -> str:
        return start_node(containers, project_image, "SING", rank, network, out, mnist, *command, env=aws,
                          runs_at=out_at, name=name)  # fmt: skip

    nodes = [start(rank, f"first-{rank}") for rank in (0, 1)]
    wait_for_file(out / "step-3", lambda: True, lambda: containers.logs(nodes[0]))
    podman("stop", "--time", "60", *nodes, timeout=120)  # SIGTERM to PID 1, SIGKILL after 60 s
    codes = [containers.exit_code(node) for node in nodes]
    first_log = containers.logs(nodes[0])
    assert codes == [143, 143], first_log[-4000:] + containers.logs(nodes[1])[-4000:]
    s3 = s3_client(aws)
    pointer = json.loads(s3.get_object(Bucket=BUCKET, Key="job/latest")["Body"].read())
    assert pointer["file"] == "preempted.ckpt" and 3 < pointer["step"] < planned, pointer
    stored = f"job/{pointer['checkpoint']}"
    assert s3.head_object(Bucket=BUCKET, Key=stored)["ContentLength"] == pointer["bytes"]
    assert f"stored as s3://{BUCKET}/{stored}" in first_log, first_log[-4000:]

    podman("rm", *nodes)  # the nodes are gone, and their disks with them
    nodes = [start(rank, f"second-{rank}") for rank in (0, 1)]
    log = assert_finished(containers, nodes)
    resumed = f"resuming from s3://{BUCKET}/{stored} (step {pointer['step']}), newer than any checkpoint in {on_disk}"
    assert resumed in log, log[-4000:]
    reports = assert_one_process_group(out, NODES * PROCESSES_PER_NODE, PROCESSES_PER_NODE, log)
    assert reports[0]["global_step"] == planned
    final = json.loads(s3.get_object(Bucket=BUCKET, Key="job/latest")["Body"].read())
    assert final["step"] == planned, final


def test_a_killed_container_ends_the_job_naming_the_lost_node(project_image, containers, runs, mnist):
    network = containers.network("kill")
    timeout = 30
    paced = ["--trainer.limit_train_batches", "1.0", "--trainer.max_epochs", "10", "--cluster.timeout",
             f"0:00:{timeout}", "--trainer.callbacks+=trainkit.testing.pacing.PaceSteps", "--trainer.callbacks.marker",
             str(RUNS / "step-3"), "--trainer.callbacks.at_step", "3"]  # fmt: skip
    nodes = [start_node(containers, project_image, "POD", rank, network, runs, mnist, *paced) for rank in (0, 1)]
    wait_for_file(runs / "step-3", lambda: True, lambda: containers.logs(nodes[0]))

    podman("kill", "--signal", "KILL", nodes[1])
    killed = time.monotonic()
    code = containers.wait(nodes[0], timeout=timeout + 60)
    log = containers.logs(nodes[0])
    assert code != 0, log[-4000:]
    assert time.monotonic() - killed < timeout, log[-4000:]
    # Node 1 named with both its processes (the second may answer before the kill reaches it).
    assert "probably died or was stopped" in log and "node 1 (host test-1, global ranks 2, 3" in log, log[-4000:]
    assert "node 0" not in log.rpartition("lost contact")[2], log[-4000:]


# The sharded strategy (FSDP2) with the tests' tiny model as its author makes it ready for sharding.
def test_two_containers_train_one_sharded_job_into_the_shared_volume(project_image, containers, runs, mnist):
    """Each of the 4 processes holds a part of the weights; each writes its shard of one checkpoint directory."""
    network = containers.network("sharded")
    nodes = [start_node(containers, project_image, "SING", rank, network, runs, mnist, *SHARDED) for rank in (0, 1)]
    log = assert_finished(containers, nodes)
    assert_one_sharded_job(runs, NODES * PROCESSES_PER_NODE, PROCESSES_PER_NODE, log)


def test_sharded_containers_with_run_directories_of_their_own_are_refused(project_image, containers, tmp_path, mnist):
    """Each container's runs on a volume of its own: no node could resume from the others' shards.

    One process per container is enough to show it, and spares each container a second start of Python.
    """
    network = containers.network("unshared")
    nodes = [start_node(containers, project_image, "SING", rank, network, shared_volume(tmp_path / f"runs-{rank}"),
                        mnist, *SHARDED, "--trainer.devices", "1") for rank in (0, 1)]  # fmt: skip
    codes = [containers.wait(node, 300) for node in nodes]
    logs = [containers.logs(node) for node in nodes]
    assert codes == [2, 2], logs[0][-4000:] + logs[1][-4000:]
    for log in logs:
        assert "error: sharded checkpoints need a directory every node sees" in log, log[-4000:]
        assert "Traceback" not in log, log[-4000:]


# ---- Docker Swarm ------------------------------------------------------------------------------


def docker_clients() -> dict[str, str]:
    """Debian's docker.io client (20.10) and, where another is on PATH, that one too."""
    clients = {"docker.io": DEBIAN_CLI}
    other = shutil.which("docker")
    if other and Path(other).resolve() != Path(DEBIAN_CLI).resolve():
        clients["PATH"] = other
    return clients


@pytest.fixture(scope="module")
def swarm(project_image, tmp_path_factory):
    with DockerSwarm(tmp_path_factory.mktemp("swarm")) as started:
        started.load_from_podman(project_image)
        yield started


def cpu_stack(compose_file: Path, image: str, data: Path) -> dict:
    """The generated stack with only what one machine without GPUs forces changed.

    The image name; processes per node (torchrun's "gpu" means none here); no GPU reservations
    and no placement labels (one machine); the test data mounted, and a quick CPU run.
    """
    stack = yaml.safe_load(compose_file.read_text())
    for service in stack["services"].values():
        command = list(service["command"])
        command[command.index("--nproc-per-node") + 1] = str(PROCESSES_PER_NODE)
        service["command"] = [*command, *quick_cpu_run(DATA, RUNS)]
        service["image"] = image
        service["volumes"] = [*service["volumes"], f"{data}:{DATA}:ro"]
        service["deploy"] = {key: value for key, value in service["deploy"].items()
                             if key not in ("resources", "placement")}  # fmt: skip
    return stack


def wait_for_stack(swarm: DockerSwarm, stack: str, timeout: float = 180) -> None:
    """Until every task of the stack has completed; a failed task fails the test with the services' logs."""
    deadline = time.monotonic() + timeout
    while True:
        tasks = swarm.docker("stack", "ps", stack, "--no-trunc", "--format", "{{.Name}}: {{.CurrentState}} {{.Error}}")
        states = tasks.stdout.strip().splitlines()
        if states and all(": Complete" in state for state in states):
            return
        if any(": Failed" in state or ": Rejected" in state for state in states) or time.monotonic() > deadline:
            logs = swarm.docker("service", "logs", "--raw", f"{stack}_node0", check=False)
            pytest.fail(f"stack {stack}: {states}\n{logs.stdout[-3000:]}{logs.stderr[-3000:]}")
        time.sleep(1)


def remove_stack(swarm: DockerSwarm, stack: str, timeout: float = 60) -> None:
    """`docker stack rm`, then wait until its containers and network are gone, and remove its volume."""
    swarm.docker("stack", "rm", stack, check=False)
    ours = f"label=com.docker.stack.namespace={stack}"
    deadline = time.monotonic() + timeout
    listings = (["ps", "--all"], ["network", "ls"])
    while any(swarm.docker(*listing, "--quiet", "--filter", ours).stdout.strip() for listing in listings):
        assert time.monotonic() < deadline, f"stack {stack} was not removed"
        time.sleep(0.5)
    swarm.docker("volume", "rm", f"{stack}_runs", check=False)


@pytest.mark.parametrize("client", ["docker.io", "PATH"])
def test_swarm_stack_trains_as_one_job(client, swarm, project_image, default_project, mnist, tmp_path):
    cli = docker_clients().get(client)
    if cli is None:
        pytest.skip("no Docker client on PATH besides Debian's docker.io")
    stack_name = f"lmt{client.replace('.', '')}"
    compose = tmp_path / "compose.yaml"
    compose.write_text(yaml.safe_dump(cpu_stack(default_project / "launch" / "swarm" / "compose.yaml",
                                                project_image, mnist)))  # fmt: skip
    try:
        swarm.docker("stack", "deploy", "--resolve-image", "never", "--compose-file", str(compose), stack_name, cli=cli)
        wait_for_stack(swarm, stack_name)
        volume = swarm.docker("volume", "inspect", "--format", "{{.Mountpoint}}", f"{stack_name}_runs").stdout.strip()
        reports = assert_one_process_group(Path(volume), NODES * PROCESSES_PER_NODE, PROCESSES_PER_NODE)
        assert reports[0]["global_step"] == TRAIN_STEPS
    finally:
        remove_stack(swarm, stack_name)
