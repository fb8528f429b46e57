"""Checkpoints in an object store, against a real S3 API server (moto's) on 127.0.0.1, through boto3 as users run it.

The server enforces credentials: `writer` may do anything, `reader` may only list and read.
"""

import hashlib
import io
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from trainkit.checkpoints.io import AtomicCheckpointIO
from trainkit.checkpoints.resume import newer_from_store
from trainkit.checkpoints.stored import StoredCheckpointIO, family, stored_name
from trainkit.store.object_store import FsspecStore, StoreConflict, StoreError, open_store
from trainkit.testing.runs import training_pid

from .drills import (
    exit_code,
    full_epochs_args,
    last_words,
    load,
    node_envs,
    paced,
    start,
    start_nodes,
    wait_for,
    with_periodic,
)
from .helpers import TRAIN_SCRIPT, clean_env, free_port, run_train
from .test_run_lock import held

pytestmark = pytest.mark.slow
boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto.server", reason="moto[server] is in the project's test extra: pip install -e '.[test]'")

BUCKET = "checkpoints"


@dataclass
class S3Server:
    endpoint: str
    process: subprocess.Popen
    keys: dict[str, tuple[str, str]]  # user -> (access key id, secret key)

    def env(self, user: str = "writer", base: dict[str, str] | None = None, **more: str) -> dict[str, str]:
        """`base` (a clean environment by default) with `user`'s credentials for this server, as AWS tools read them."""
        key_id, secret = self.keys[user]
        aws = {"AWS_ACCESS_KEY_ID": key_id, "AWS_SECRET_ACCESS_KEY": secret, "AWS_ENDPOINT_URL": self.endpoint,
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
               "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent"}  # fmt: skip
        return {**(clean_env() if base is None else base), **aws, **more}

    def client(self, user: str = "writer"):
        key_id, secret = self.keys[user]
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=key_id, aws_secret_access_key=secret,
                            region_name="us-east-1")  # fmt: skip

    def names(self, prefix: str) -> set[str]:
        found = self.client().list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/").get("Contents", [])
        return {entry["Key"].removeprefix(prefix + "/") for entry in found}

    def pointer(self, prefix: str) -> dict | None:
        try:
            return json.loads(self.client().get_object(Bucket=BUCKET, Key=f"{prefix}/latest")["Body"].read())
        except self.client().exceptions.NoSuchKey:
            return None

    def read(self, key: str) -> bytes:
        return self.client().get_object(Bucket=BUCKET, Key=key)["Body"].read()


def start_s3_server(log: Path, with_credentials: bool) -> S3Server:
    port = free_port()
    # With credentials checked, the first requests (the setup below) need none; every later one does.
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "7"} if with_credentials else dict(os.environ)
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    with log.open("w") as output:  # the server writes its own copy
        process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
    endpoint = f"http://127.0.0.1:{port}"
    setup = {"endpoint_url": endpoint, "region_name": "us-east-1", "aws_access_key_id": "setup",
             "aws_secret_access_key": "setup"}  # fmt: skip
    boto3.client("s3", **setup).create_bucket(Bucket=BUCKET)
    keys = {"writer": ("setup", "setup")}
    if with_credentials:
        iam = boto3.client("iam", **setup)
        for user, actions in (("writer", ["s3:*"]), ("reader", ["s3:ListBucket", "s3:GetObject"])):
            iam.create_user(UserName=user)
            policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": actions, "Resource": "*"}]}
            iam.put_user_policy(UserName=user, PolicyName=user, PolicyDocument=json.dumps(policy))
        keys = {}
        for user in ("writer", "reader"):
            key = boto3.client("iam", **setup).create_access_key(UserName=user)["AccessKey"]
            keys[user] = (key["AccessKeyId"], key["SecretAccessKey"])
    return S3Server(endpoint, process, keys)


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory):
    server = start_s3_server(tmp_path_factory.mktemp("s3") / "server.log", with_credentials=True)
    yield server
    server.process.kill()
    server.process.wait()


def store_args(prefix: str, *extra: str) -> list[str]:
    return ["--checkpoint_store.url", f"s3://{BUCKET}/{prefix}", *extra]


def assert_complete(server: S3Server, prefix: str) -> dict:
    """The pointer names an object that is all there: the hash the pointer gives, and a whole checkpoint."""
    pointer = server.pointer(prefix)
    assert pointer is not None, "no pointer in the store"
    data = server.read(f"{prefix}/{pointer['checkpoint']}")
    assert len(data) == pointer["bytes"] and hashlib.sha256(data).hexdigest() == pointer["sha256"]
    assert zipfile.ZipFile(io.BytesIO(data)).testzip() is None
    assert torch.load(io.BytesIO(data), weights_only=True)["global_step"] == pointer["step"]
    return pointer


def test_a_preempted_two_node_job_resumes_from_the_bucket_on_a_fresh_disk(s3, experiment, tmp_path):
    port = free_port()
    # 2 nodes x 2 processes, batches of 16: 9 steps an epoch. DDP sums the gradients of 3 or more processes
    # in an order that depends on its bucket layout, which it rebuilds after a run's first step: the first
    # step after a restart would round differently (by 3e-8 here). find_unused_parameters keeps one layout.
    common = [*full_epochs_args(experiment, tmp_path / "run"), "--data.batch_size", "16", "--trainer.devices", "2",
              "--cluster.main_port", str(port), "--trainer.strategy", "lightning.pytorch.strategies.DDPStrategy",
              "--trainer.strategy.find_unused_parameters", "true",
              "--trainer.strategy.start_method", "popen"]  # fmt: skip
    disks = [tmp_path / f"node{rank}-disk" for rank in range(2)]  # as on SING: each container has a disk of its own

    def on_each_disk(*args: str) -> list[list[str]]:
        train = [sys.executable, str(TRAIN_SCRIPT), "fit", *common, *args]
        return [[*train, "--trainer.default_root_dir", str(disk / "run")] for disk in disks]

    reference = start_nodes(on_each_disk(), node_envs("SING", port), tmp_path / "reference")
    assert [exit_code(node, 240, "the reference run hung") for node in reference] == [0, 0]
    expected = load(disks[0] / "run" / "checkpoints" / "last.ckpt")
    for disk in disks:
        shutil.rmtree(disk)

    marker = tmp_path / "step-4"
    commands = on_each_disk(*store_args("job"), *paced(marker, at_step=4))
    envs = [s3.env(base=env) for env in node_envs("SING", port)]
    logs = tmp_path / "preempted"
    nodes = start_nodes(commands, envs, logs)
    wait_for(marker, nodes[0], logs / "node0.log")
    for node in nodes:  # the platform stops every node's container
        node.send_signal(signal.SIGTERM)
    assert [exit_code(node, 120, "the preempted job hung") for node in nodes] == [143, 143]
    pointer = assert_complete(s3, "job")
    assert pointer["file"] == "preempted.ckpt" and pointer["step"] % 9, pointer  # mid-epoch
    url = f"s3://{BUCKET}/job/{pointer['checkpoint']}"
    assert f"stored as {url}" in (logs / "node0.log").read_text()
    run_id = s3.read("job/wandb-run-id").decode()
    shown = subprocess.run([sys.executable, "-m", "trainkit.checkpoints.provenance", url],
                           env=s3.env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert shown.returncode == 0 and f"step      {pointer['step']} (epoch" in shown.stdout, shown.stderr[-3000:]

    for disk in disks:  # new containers: nothing of the run on their disks
        shutil.rmtree(disk)
    nodes = start_nodes(commands, envs, tmp_path / "resumed")
    assert [exit_code(node, 240, "the resumed job hung") for node in nodes] == [0, 0]
    log = (tmp_path / "resumed" / "node0.log").read_text()  # node 1 downloads too: else it would not train in step
    assert f"resuming from {url} (step {pointer['step']})" in log, log[-3000:]
    actual = load(disks[0] / "run" / "checkpoints" / "last.ckpt")
    assert actual["global_step"] == expected["global_step"] == 18
    for name, tensor in expected["state_dict"].items():
        assert torch.equal(tensor, actual["state_dict"][name]), f"{name} differs after resuming from the bucket"
    assert (disks[0] / "run" / "checkpoints" / "wandb-run-id").read_text() == run_id
    offline_runs = [path.name for path in (disks[0] / "run" / "wandb").glob("offline-run-*")]
    assert offline_runs and all(name.endswith(f"-{run_id}") for name in offline_runs)

    # Nothing secret in what the run wrote: not on its disks, not in the bucket.
    secret = s3.keys["writer"][1].encode()
    written = [path for disk in disks for path in disk.rglob("*") if path.is_file()]
    assert written and not [path for path in written if secret in path.read_bytes()]
    assert not [name for name in s3.names("job") if secret in s3.read(f"job/{name}")]


def test_a_writer_killed_at_any_moment_leaves_a_complete_checkpoint_to_resume_from(s3, experiment, tmp_path):
    # 10 MB checkpoints, one after every step, each uploaded while training goes on; the kills land at
    # different moments of an upload. Each time the pointer must name a whole checkpoint.
    run_dir = tmp_path / "run"
    args = ["fit", *full_epochs_args(with_periodic(experiment, every_n_steps=1), run_dir, epochs=3),
            "--model.init_args.hidden", "40000", *store_args("killed", "--checkpoint_store.keep", "2")]  # fmt: skip
    rng = random.Random(0)
    steps, mid_upload = [], 0
    for kill in range(5):
        before = s3.pointer("killed")
        log = tmp_path / f"killed-{kill}.log"
        job = start(args, s3.env(), log)
        deadline = time.monotonic() + 120
        while s3.pointer("killed") == before:  # this run has stored something
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.02)
        while not any((run_dir / "checkpoints").glob(".*.upload-*")):  # then the next upload begins
            assert job.poll() is None, log.read_text()[-3000:]
            time.sleep(0.005)  # not a busy loop: the job needs the cores
        time.sleep(rng.uniform(0, 0.05))
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        mid_upload += any((run_dir / "checkpoints").glob(".*.upload-*"))  # a checkpoint not yet (all) stored
        steps.append(assert_complete(s3, "killed")["step"])
    assert steps == sorted(steps) and steps[-1] < 54, steps
    assert mid_upload >= 3, f"only {mid_upload} of 5 kills landed while a checkpoint was being stored"

    shutil.rmtree(run_dir)
    finished = run_train(*args, env=s3.env())
    assert finished.returncode == 0, finished.stderr[-4000:]
    assert f"(step {steps[-1]}), newer than any checkpoint" in finished.stderr + finished.stdout
    last = load(run_dir / "checkpoints" / "last.ckpt")
    assert last["global_step"] == 54

    # Retention: the newest 2 of each rolling checkpoint, and the best one, nothing else.
    best = next(Path(state["best_model_path"]).name for key, state in last["callbacks"].items()
                if key.startswith("BestCheckpoint") and state.get("monitor"))  # fmt: skip
    expected = {"periodic-step=54.ckpt", "periodic-step=53.ckpt", "last-step=54.ckpt", "last-step=36.ckpt", best}
    assert s3.names("killed") == {"latest", "wandb-run-id", *(f"checkpoints/{name}" for name in expected)}
    assert s3.pointer("killed")["step"] == 54

    # On a fresh disk, `test --ckpt_path best` finds the best checkpoint in the store too.
    shutil.rmtree(run_dir)
    tested = run_train("test", *args[1:], "--ckpt_path", "best", env=s3.env())
    assert tested.returncode == 0, tested.stderr[-3000:]
    assert (run_dir / "checkpoints" / best).is_file() and "test/acc" in tested.stdout


def test_a_store_that_stops_answering_ends_the_job_and_loses_nothing_stored(experiment, tmp_path):
    server = start_s3_server(tmp_path / "server.log", with_credentials=False)
    try:
        run_dir, marker, log = tmp_path / "run", tmp_path / "step-4", tmp_path / "train.log"
        # keep 20: no version is deleted, so every object stored before the stop must still be there after it.
        config = with_periodic(experiment, every_n_steps=2)
        args = ["fit", *full_epochs_args(config, run_dir), *paced(marker, at_step=4),
                *store_args("stopped", "--checkpoint_store.timeout", "1", "--checkpoint_store.keep", "20")]  # fmt: skip
        job = start(args, server.env(), log)
        wait_for(marker, job, log)
        stored = server.names("stopped")
        assert "latest" in stored
        server.process.send_signal(signal.SIGSTOP)  # the server still accepts connections, and never answers
        try:
            assert exit_code(job, 120, "the job went on without its store") == 74, log.read_text()[-4000:]
        finally:
            server.process.send_signal(signal.SIGCONT)
        assert last_words(log).startswith(f"error: could not store a checkpoint: s3://{BUCKET}/stopped/")
        assert "cannot reach the store at http://127.0.0.1:" in last_words(log)
        assert "Traceback" not in log.read_text()
        assert stored <= server.names("stopped")  # nothing already stored was lost
        pointer = assert_complete(server, "stopped")
        assert load(run_dir / "checkpoints" / "periodic.ckpt")["global_step"] > pointer["step"]

        shutil.rmtree(run_dir)
        resumed = run_train(*args, env=server.env())
        assert resumed.returncode == 0, resumed.stderr[-4000:]
        assert f"(step {pointer['step']}), newer than any checkpoint" in resumed.stderr + resumed.stdout
    finally:
        server.process.kill()
        server.process.wait()


def test_a_store_that_cannot_be_used_ends_the_run_before_training_in_one_line(s3, experiment, tmp_path):
    closed_port = free_port()
    cases = {
        "no-bucket": (s3.env(), "s3://no-such-bucket/run", "bucket no-such-bucket does not exist"),
        "no-credentials": ({**s3.env(), "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""},
                           f"s3://{BUCKET}/run", "no credentials for the store"),
        "unreachable": (s3.env(AWS_ENDPOINT_URL=f"http://127.0.0.1:{closed_port}"), f"s3://{BUCKET}/run",
                        f"cannot reach the store at http://127.0.0.1:{closed_port}"),
        "read-only": (s3.env("reader"), f"s3://{BUCKET}/run", "access denied"),
    }  # fmt: skip
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        cases["no-credentials"][0].pop(name)
    jobs = {}
    for case, (env, url, _) in cases.items():
        args = ["fit", *full_epochs_args(experiment, tmp_path / case), "--checkpoint_store.url", url,
                "--checkpoint_store.timeout", "2"]  # fmt: skip
        jobs[case] = start(args, env, tmp_path / f"{case}.log")
    for case, (_, url, reason) in cases.items():
        log = tmp_path / f"{case}.log"
        assert exit_code(jobs[case], 120, f"{case}: hung") == 2, log.read_text()[-3000:]
        errors = [line for line in log.read_text().splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and url in errors[0] and reason in errors[0], (case, log.read_text()[-3000:])
        assert "Traceback" not in log.read_text(), case
        assert not (tmp_path / case / "checkpoints").exists() or not list((tmp_path / case).rglob("*.ckpt")), case


def test_a_second_job_on_one_store_location_is_refused_and_a_killed_ones_lock_taken_over(s3, experiment, tmp_path):
    # Each job has a disk of its own (another machine): only the store's lock can tell them apart.
    def args(run: str, *extra: str) -> list[str]:
        return ["fit", *full_epochs_args(experiment, tmp_path / run), *store_args("locked"), *extra]

    # The first job waits at step 2 until it is killed: on a busy machine the second one's start-up alone
    # can outlast a whole paced run, which would leave no lock to refuse it.
    marker, log = tmp_path / "step-2", tmp_path / "first.log"
    first = start(args("first", *held(marker, tmp_path / "never", at_step=2)), s3.env(), log)
    wait_for(marker, first, log)
    holder = training_pid(first)  # the lock is the training process's (run/supervisor.py)
    second = run_train(*args("second"), env=s3.env())
    assert first.poll() is None, "the first job must still hold the lock"
    errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
    assert second.returncode == 2 and len(errors) == 1, second.stderr[-3000:]
    assert f"checkpoint store s3://{BUCKET}/locked is in use by another job: host {socket.gethostname()}, process" \
           f" {holder}, started" in errors[0]  # fmt: skip
    assert not (tmp_path / "second" / "checkpoints").exists() or not list((tmp_path / "second").rglob("*.ckpt"))

    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    third = run_train(*args("third"), env=s3.env())
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"taking over the lock of host {socket.gethostname()}, process {holder}" in third.stderr + third.stdout
    assert f"process {holder} has ended" in third.stderr + third.stdout
    assert "run.lock" not in s3.names("locked")  # released when the job ended


def test_two_jobs_writing_one_location_cannot_cross(s3, tmp_path, monkeypatch):
    for name, value in s3.env().items():
        if name.startswith("AWS_"):
            monkeypatch.setenv(name, value)
    first, second = (StoredCheckpointIO(open_store(f"s3://{BUCKET}/crossed", timeout=5)) for _ in range(2))
    checkpoint = {"state_dict": {"weight": torch.ones(2)}, "global_step": 1}
    first.save_checkpoint(checkpoint, tmp_path / "a" / "last.ckpt")
    first.wait()
    second.save_checkpoint({**checkpoint, "global_step": 2}, tmp_path / "b" / "last.ckpt")
    second.wait()  # it read the pointer after the first job wrote it: fine
    first.save_checkpoint({**checkpoint, "global_step": 3}, tmp_path / "a" / "last.ckpt")
    with pytest.raises(Exception, match=r"latest was moved by another job \(host .*, process \d+\): one job per"):
        first.wait()
    assert s3.pointer("crossed")["step"] == 2  # the second job's pointer stands


def test_a_best_checkpoint_a_killed_run_did_not_store_is_stored_by_the_next_run(s3, tmp_path, monkeypatch):
    # A run wrote best-epoch=0-step=18.ckpt and was killed while uploading it. No later save replaces a best
    # checkpoint, and the run resumed on the same disk still names it as its best: it stores it at its first save,
    # and the pointer stays on the newest checkpoint.
    for name, value in s3.env().items():
        if name.startswith("AWS_"):
            monkeypatch.setenv(name, value)
    checkpoints = tmp_path / "job" / "checkpoints"
    killed = StoredCheckpointIO(open_store(f"s3://{BUCKET}/backfill", timeout=5))
    killed.save_checkpoint({"state_dict": {"weight": torch.ones(2)}, "global_step": 17}, checkpoints / "periodic.ckpt")
    killed.wait()
    AtomicCheckpointIO().save_checkpoint(
        {"state_dict": {"weight": torch.full((2,), 18.0)}, "global_step": 18}, checkpoints / "best-epoch=0-step=18.ckpt"
    )  # written, its upload never begun

    resumed = StoredCheckpointIO(open_store(f"s3://{BUCKET}/backfill", timeout=5))
    resumed.save_checkpoint({"state_dict": {"weight": torch.ones(2)}, "global_step": 19}, checkpoints / "periodic.ckpt")
    resumed.wait()
    assert s3.names("backfill") >= {"checkpoints/best-epoch=0-step=18.ckpt", "checkpoints/periodic-step=19.ckpt"}
    assert s3.pointer("backfill")["step"] == 19
    stored = tmp_path / "stored.ckpt"
    s3.client().download_file(BUCKET, "backfill/checkpoints/best-epoch=0-step=18.ckpt", str(stored))
    assert load(stored)["global_step"] == 18
    assert not list(checkpoints.glob(".*")), "snapshots left behind"


def test_resume_skips_a_damaged_or_vanished_stored_checkpoint_for_the_next_newest(s3, tmp_path, monkeypatch, caplog):
    for name, value in s3.env().items():
        if name.startswith("AWS_"):
            monkeypatch.setenv(name, value)
    io = StoredCheckpointIO(open_store(f"s3://{BUCKET}/fallback", timeout=5), keep=5)
    for step in (3, 5, 7):
        io.save_checkpoint({"state_dict": {"weight": torch.full((2,), step)}, "global_step": step},
                           tmp_path / "job" / "periodic.ckpt")  # fmt: skip
    io.wait()
    client = s3.client()
    client.delete_object(Bucket=BUCKET, Key="fallback/checkpoints/periodic-step=7.ckpt")  # the pointer's: gone
    client.put_object(Bucket=BUCKET, Key="fallback/checkpoints/periodic-step=5.ckpt", Body=b"PK\x03\x04 cut short")

    found = newer_from_store(io.store, tmp_path / "fresh", local_step=-1)
    assert found == tmp_path / "fresh" / "periodic-step=3.ckpt" and load(found)["global_step"] == 3
    skipped = [record.getMessage() for record in caplog.records if record.getMessage().startswith("skipped")]
    assert skipped == [f"skipped s3://{BUCKET}/fallback/checkpoints/periodic-step=7.ckpt: it is gone from the store",
                       f"skipped s3://{BUCKET}/fallback/checkpoints/periodic-step=5.ckpt: it is damaged (File is not"
                       " a zip file)"]  # fmt: skip
    assert newer_from_store(io.store, tmp_path / "fresh", local_step=3) is None  # nothing newer than the disk's


def test_stored_names_keep_each_version_apart():
    assert stored_name("last.ckpt", 36) == "last-step=36.ckpt"
    assert stored_name("best-epoch=1-step=36.ckpt", 36) == "best-epoch=1-step=36.ckpt"
    assert family("checkpoints/periodic-step=20.ckpt") == family("periodic.ckpt") == "periodic"
    assert family("best-epoch=0-step=18.ckpt") != family("best-epoch=1-step=36.ckpt")


def test_a_store_through_fsspec_writes_conditionally_and_lists(tmp_path):
    store = FsspecStore(f"file://{tmp_path}/store")
    assert store.read("latest") is None and store.names("checkpoints") == []
    version = store.write("latest", b"1", replacing=None)
    with pytest.raises(StoreConflict):
        store.write("latest", b"2", replacing=None)
    store.write("latest", b"2", replacing=version)
    (tmp_path / "file.ckpt").write_bytes(b"weights")
    store.upload(tmp_path / "file.ckpt", "checkpoints/file-step=1.ckpt")
    assert store.names("checkpoints") == ["checkpoints/file-step=1.ckpt"]
    store.download("checkpoints/file-step=1.ckpt", tmp_path / "copy.ckpt")
    assert (tmp_path / "copy.ckpt").read_bytes() == b"weights"
    with pytest.raises(StoreError, match="nosuchproto"):
        open_store("nosuchproto://bucket/x", timeout=5)
