"""The promises under preemption, restarts, lost nodes and bad input, each shown by doing the bad thing for real."""

import os
import pickle
import signal
import subprocess
import sys
import time
import zipfile
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

from trainkit.run import stopping
from trainkit.run.node_watch import POLL_SECONDS, StartedProcessesWatch

from .drills import (
    STEPS_PER_EPOCH,
    exit_code,
    full_epochs_args,
    group_is_gone,
    last_words,
    load,
    paced,
    process_tree,
    start,
    wait_for,
)
from .helpers import clean_env, free_port, quick_run_args, run_train

pytestmark = pytest.mark.slow


def test_lightnings_process_watcher_spares_the_node_once_its_processes_leave_the_list(monkeypatch):
    # After a preemption the processes Lightning started exit 143 before the first one; its watcher
    # would SIGKILL the first one for that. PreemptionCheckpoint empties the launcher's list of
    # processes, which the watcher reads: this fails if a Lightning release stops sharing that list.
    killed = []
    monkeypatch.setattr(os, "kill", lambda pid, signum: killed.append(pid))
    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(143)"])
    child.wait()

    watched = [child]
    watcher = _ChildProcessObserver(main_pid=os.getpid(), child_processes=watched)
    assert watcher._run() and killed == [os.getpid()]  # a child exited non-zero: the node is killed

    killed.clear()
    watched = [child]
    watcher = _ChildProcessObserver(main_pid=os.getpid(), child_processes=watched)
    watched.clear()
    assert watcher._run() and killed == []


def test_the_kits_process_watcher_spares_a_node_that_is_ending_on_its_own(monkeypatch):
    # SIGTERM before training: the first process passes it on and exits 143 once the processes it started have.
    # They exit 143 first; Lightning's watcher would SIGKILL the first process for that (the node exits 137).
    killed = []
    monkeypatch.setattr(os, "kill", lambda pid, signum: killed.append(pid))
    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(143)"])
    child.wait()

    monkeypatch.setattr(stopping, "_ending", True)
    assert StartedProcessesWatch(os.getpid(), [child], POLL_SECONDS, notice_seconds=1)._run() and killed == []
    monkeypatch.setattr(stopping, "_ending", False)
    assert StartedProcessesWatch(os.getpid(), [child], POLL_SECONDS, notice_seconds=1)._run()
    assert killed == [os.getpid()]  # not ending: a child that exited non-zero ends the node, as in Lightning


def exit_here(status: int) -> None:
    raise SystemExit(status)


def test_the_kits_process_watcher_ends_the_node_with_the_status_of_a_process_that_failed_on_its_own(
    monkeypatch, capsys
):
    monkeypatch.setattr(os, "_exit", exit_here)  # the node's first process is this test's: it is not ended
    monkeypatch.delenv("NODE_RANK", raising=False)  # node 0
    failed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    failed.wait()
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with pytest.raises(SystemExit) as ended:
        StartedProcessesWatch(os.getpid(), [running, failed], POLL_SECONDS, notice_seconds=1)._run()
    assert ended.value.code == 1 and running.wait(timeout=10) == -signal.SIGKILL
    assert f"error: global rank 2 (local rank 2, pid {failed.pid}) failed with exit 1" in capsys.readouterr().err


def test_with_fast_steps_the_processes_agree_every_few_steps_and_still_stop_at_the_same_step(experiment, tmp_path):
    # Steps of about 30 ms: the processes agree on a stop every few steps (every 0.5 s), not after each one.
    run_dir, marker, log, samples = tmp_path / "run", tmp_path / "step-5", tmp_path / "train.log", tmp_path / "samples"
    args = ["fit", *full_epochs_args(experiment, run_dir), "--data.train_size", "8192", "--trainer.devices", "2",
            *paced(marker, at_step=5), "--trainer.callbacks.seconds_per_step", "0.02",
            "--trainer.callbacks+=trainkit.testing.training_samples.RecordTrainingSamples",
            "--trainer.callbacks.out_dir", str(samples)]  # fmt: skip
    job = start(args, clean_env(), log)
    wait_for(marker, job, log)
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=60) == 143, log.read_text()[-4000:]

    checkpoints = run_dir / "checkpoints"
    step = load(checkpoints / "preempted.ckpt")["global_step"]
    assert 5 < step < 8192 // 32 // 2  # after the signal, in the first epoch (128 steps)
    assert last_words(log) == f"SIGTERM: saved {checkpoints / 'preempted.ckpt'} at step {step}; exiting (143)"
    trained = [len((samples / f"rank{rank}.jsonl").read_text().splitlines()) for rank in range(2)]
    assert trained == [step, step], "every process stopped at the same step"


def test_sigterm_to_every_process_of_the_job_still_saves_a_checkpoint(experiment, tmp_path):
    # Slurm signals every process of a task, wandb's service process among them, which then ends;
    # the run logs every step here, so a wandb call comes between the signal and the stop.
    run_dir, marker, log = tmp_path / "run", tmp_path / "step-3", tmp_path / "train.log"
    args = ["fit", *full_epochs_args(experiment, run_dir), "--trainer.devices", "2",
            "--trainer.log_every_n_steps", "1", *paced(marker, at_step=3)]  # fmt: skip
    job = start(args, clean_env(), log)
    wait_for(marker, job, log)
    tree = process_tree(job.pid)
    assert any(Path(f"/proc/{pid}/comm").read_text().strip() == "wandb-core" for pid in tree)
    for pid in tree:  # as Slurm does: wandb's service runs in a session of its own, out of the job's group
        os.kill(pid, signal.SIGTERM)
    assert job.wait(timeout=60) == 143, log.read_text()[-4000:]
    assert load(run_dir / "checkpoints" / "preempted.ckpt")["global_step"] > 3
    assert "Traceback" not in log.read_text(), log.read_text()[-4000:]


def test_a_wandb_service_that_dies_mid_training_ends_only_the_logging(experiment, tmp_path):
    # wandb logs through a service process of its own (wandb-core), which may die alone: the OOM killer, a crash, or a
    # stop signal that reached it first. The step that was logging when it died, and every step after, trains on.
    run_dir, marker, log = tmp_path / "run", tmp_path / "step-3", tmp_path / "train.log"
    args = ["fit", *full_epochs_args(experiment, run_dir, epochs=1), "--trainer.log_every_n_steps", "1",
            *paced(marker, at_step=3)]  # fmt: skip
    job = start(args, clean_env(), log)
    wait_for(marker, job, log)
    services = [pid for pid in process_tree(job.pid) if Path(f"/proc/{pid}/comm").read_text().strip() == "wandb-core"]
    assert services, "no wandb service to stop"
    for pid in services:
        os.kill(pid, signal.SIGKILL)
    assert job.wait(timeout=120) == 0, log.read_text()[-4000:]
    assert load(run_dir / "checkpoints" / "last.ckpt")["global_step"] == STEPS_PER_EPOCH
    lost = [line for line in log.read_text().splitlines() if "wandb's service" in line]
    assert len(lost) == 1 and "logs nothing more" in lost[0], lost
    assert "Traceback" not in log.read_text()


def test_sigterm_during_the_sanity_check_ends_every_process_at_once_saving_nothing(experiment, tmp_path):
    run_dir, marker, log = tmp_path / "run", tmp_path / "sanity-check", tmp_path / "train.log"
    args = ["fit", *full_epochs_args(experiment, run_dir), "--trainer.devices", "2",
            "--trainer.callbacks+=trainkit.testing.pacing.PaceSanityCheck",
            "--trainer.callbacks.marker", str(marker)]  # fmt: skip
    job = start(args, clean_env(), log)
    wait_for(marker, job, log)
    job.send_signal(signal.SIGTERM)  # before training starts: nothing to save yet
    assert job.wait(timeout=10) == 143, log.read_text()[-4000:]
    time.sleep(1)
    assert group_is_gone(job), "a process of the job is still running"
    assert not (run_dir / "checkpoints" / "preempted.ckpt").exists()


STOPS = {  # the signal, whether the whole group gets it, the exit status
    "sigterm-to-the-first-process": (signal.SIGTERM, False, 143),  # Kubernetes, Docker
    "sigint-to-the-group": (signal.SIGINT, True, 130),  # Ctrl-C; Slurm signals every process too
}


@pytest.mark.parametrize("stop", STOPS)
def test_a_stop_while_waiting_for_the_started_processes_is_not_taken_for_a_lost_peer(experiment, tmp_path, stop):
    # The first process waits in a collective for the one Lightning started, which leaves on the same signal (passed
    # on to it, or sent to the whole group as Slurm and Ctrl-C do): the collective fails as soon as it left, and that
    # failure must not turn the stop into a lost peer (75).
    run_dir, marker, log = tmp_path / "run", tmp_path / "waiting", tmp_path / "train.log"
    args = ["fit", *full_epochs_args(experiment, run_dir), "--trainer.devices", "2",
            "--trainer.callbacks+=trainkit.testing.pacing.PaceSetup",
            "--trainer.callbacks.marker", str(marker)]  # fmt: skip
    signum, to_the_group, status = STOPS[stop]
    job = start(args, clean_env(), log)
    wait_for(marker, job, log)
    time.sleep(1)  # into the collective
    if to_the_group:
        os.killpg(job.pid, signum)
    else:
        job.send_signal(signum)
    assert job.wait(timeout=30) == status, log.read_text()[-4000:]
    assert "lost contact" not in log.read_text(), log.read_text()[-4000:]
    time.sleep(1)
    assert group_is_gone(job), "a process of the job is still running"


STOPPED_WHILE_WAITING = """
import os, signal, subprocess, sys
from trainkit.run import stopping
stopping.handle_stop_signals()
started = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # as Lightning starts one
stopping.stop_with_this_process(lambda: [started])
os.kill(os.getpid(), signal.SIGTERM)  # passed on to the started process, which ends
started.wait()  # as a collective with it fails once it left: sooner than the signal's thread ends this process
stopping.let_an_exit_under_way_finish()
sys.exit(75)  # as after naming a lost peer
"""


def test_an_error_that_a_stop_signal_caused_leaves_the_exit_to_the_signal():
    result = subprocess.run([sys.executable, "-c", STOPPED_WHILE_WAITING], env=clean_env(), capture_output=True,
                            text=True, timeout=180, check=False)  # fmt: skip
    assert result.returncode == 143, result.stderr
    assert "SIGTERM: nothing to save yet" in result.stderr, result.stderr


def test_restart_resumes_exactly_and_continues_the_same_wandb_run(experiment, tmp_path):
    uninterrupted = run_train("fit", *full_epochs_args(experiment, tmp_path / "a", epochs=2))
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-4000:]
    first = run_train("fit", *full_epochs_args(experiment, tmp_path / "b", epochs=1))
    assert first.returncode == 0, first.stderr[-4000:]
    resumed = run_train("fit", *full_epochs_args(experiment, tmp_path / "b", epochs=2))
    assert resumed.returncode == 0, resumed.stderr[-4000:]

    expected, actual = (load(tmp_path / run / "checkpoints" / "last.ckpt") for run in ("a", "b"))
    assert actual["global_step"] == expected["global_step"] == 2 * STEPS_PER_EPOCH
    for name, tensor in expected["state_dict"].items():
        assert torch.equal(tensor, actual["state_dict"][name]), f"{name} differs after resuming"

    run_id = (tmp_path / "b" / "checkpoints" / "wandb-run-id").read_text()
    offline_runs = sorted(path.name for path in (tmp_path / "b" / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 2 and all(name.endswith(f"-{run_id}") for name in offline_runs)


def start_pod_nodes(args: list[str], port: int, nodes: range, tmp_path: Path) -> list[subprocess.Popen]:
    common = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return [start(args, clean_env(**common, RANK=str(rank)), tmp_path / f"node{rank}.log") for rank in nodes]


def test_a_lost_node_ends_the_job_instead_of_hanging(experiment, tmp_path):
    marker = tmp_path / "step-3"
    args = ["fit", *full_epochs_args(experiment, tmp_path / "run"), "--trainer.devices", "2",
            "--cluster.timeout", "0:00:20", *paced(marker, at_step=3)]  # fmt: skip
    node0, node1 = start_pod_nodes(args, free_port(), range(2), tmp_path)
    wait_for(marker, node0, tmp_path / "node0.log")
    os.killpg(node1.pid, signal.SIGKILL)  # the whole node: its first process and the ones Lightning started
    started = time.monotonic()
    code = exit_code(node0, timeout=20 + 60, hang="the surviving node hung")
    log = (tmp_path / "node0.log").read_text()
    assert code != 0, log[-4000:]
    assert time.monotonic() - started < 20 + 30
    time.sleep(1)
    assert group_is_gone(node0), "a process of the surviving node is still running"
    last_line = last_words(tmp_path / "node0.log")
    assert last_line.startswith("error:") and "lost contact" in last_line, log[-4000:]
    assert "node 1 (host" in last_line and "global ranks 2, 3) probably died" in last_line, log[-4000:]
    assert code == 75, log[-4000:]  # exit_codes.LOST_NODE: worth retrying


ENDING_ON_OWN_TERMS = """
import os, signal, sys, time
from trainkit.run import stopping
stopping.handle_stop_signals()
stopping.stop_at_once()  # as after an error: a signal ends the process at once
if sys.argv[1] == "lost":
    stopping.end_on_own_terms()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(1)
sys.exit(75)  # as after naming the lost node
"""


@pytest.mark.parametrize(("case", "status"), [("lost", 75), ("other error", 143)])
def test_a_process_ending_after_a_lost_peer_is_not_ended_by_sigterm_before_it(case, status):
    """torchrun stops a node's other processes once one ended: those naming the lost node still end with 75."""
    result = subprocess.run([sys.executable, "-c", ENDING_ON_OWN_TERMS, case], env=clean_env(), capture_output=True,
                            text=True, timeout=180, check=False)  # fmt: skip
    assert result.returncode == status, result.stderr


NODE_WATCH = """
import os, subprocess, sys, time
from trainkit.run import stopping
from trainkit.run.node_watch import StartedProcessesWatch
child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(75)"])  # it lost a peer and named it
child.wait()
StartedProcessesWatch(main_pid=os.getpid(), child_processes=[child], sleep_period=0.1, notice_seconds=10).start()
time.sleep(1)  # this process notices the same loss a little later
if sys.argv[1] == "notices":
    stopping.end_on_own_terms()
    time.sleep(5)
    print("named the lost node")
    sys.exit(75)
time.sleep(30)  # blocked, never noticing
"""


@pytest.mark.parametrize("case", ["notices", "never notices"])
def test_a_started_process_that_lost_a_peer_leaves_the_first_process_time_to_name_it(case):
    """The node watch does not end the node's first process while it is ending with its own line, only
    when it has not begun to within the time it was given."""
    result = subprocess.run([sys.executable, "-c", NODE_WATCH, case], env=clean_env(), capture_output=True,
                            text=True, timeout=180, check=False)  # fmt: skip
    assert result.returncode == 75, result.stderr
    if case == "notices":
        assert "named the lost node" in result.stdout and "it lost a peer" not in result.stderr, result.stderr
    else:
        assert "exited with 75: it lost a peer" in result.stderr and "named" not in result.stdout, result.stderr


def test_an_error_in_one_process_of_a_node_ends_the_node_with_its_status_not_as_a_lost_node(experiment, tmp_path):
    # A bug only one process's data meets fails again on retry: the node must not exit 75 (retry without counting),
    # nor be SIGKILLed by Lightning's watcher (137).
    args = quick_run_args(experiment, tmp_path / "run")
    failed = run_train("fit", *args, "--model", "tasks.broken.FailsOnOneProcess", "--data", "tasks.regression.Table",
                       "--best_checkpoint.monitor", "val_loss", "--trainer.devices", "2", timeout=240)  # fmt: skip
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert "RuntimeError: a row that only global rank 1 reads" in failed.stderr
    last = failed.stderr.strip().splitlines()[-1]
    assert last.startswith("error: global rank 1 (node 0, host "), failed.stderr[-3000:]
    said = "failed with RuntimeError: a row that only global rank 1 reads: its log has the traceback."
    assert last.endswith(f"{said} Global rank 0 ends with it, exiting with 1: a retry would meet the same error"), last


def test_a_node_that_never_arrives_ends_the_job(experiment, tmp_path):
    port = free_port()
    args = ["fit", *quick_run_args(experiment, tmp_path / "run"), "--trainer.devices", "2"]
    args += ["--cluster.join_timeout", "0:00:10"]
    (node0,) = start_pod_nodes(args, port, range(1), tmp_path)
    code = exit_code(node0, timeout=10 + 60, hang="node 0 waited forever for node 1")
    log = (tmp_path / "node0.log").read_text()
    assert code == 75, log[-4000:]  # exit_codes.LOST_NODE: worth retrying
    expected = f"error: only 1 of 2 nodes joined at 127.0.0.1:{port} within 0:00:10 (cluster.join_timeout): node 1"
    assert f"{expected} did not arrive" in last_words(tmp_path / "node0.log"), log[-4000:]
    assert "processes" not in log, "node 0 started its other processes before the job could form"


def write_malicious_checkpoint(path: Path, proof: Path) -> None:
    """A checkpoint whose unpickling would run a shell command (creating `proof`)."""

    class RunsCode:
        def __reduce__(self):
            return os.system, (f"touch {proof}",)

    torch.save({"state_dict": {}, "payload": RunsCode()}, path)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("unknown key", "hiden"),
        ("wrong type in YAML", "max_epochs"),
        ("data that cannot be read", "data.train_size must be at least 1"),
        ("missing checkpoint", "does not exist"),
        ("not a checkpoint", "is not a checkpoint"),
        ("checkpoint that runs code", "refused to load"),
    ],
)
def test_bad_input_is_refused_with_one_clear_message(experiment, tmp_path, case, message):
    run_dir, proof = tmp_path / "run", tmp_path / "code-ran"
    args = ["fit", *quick_run_args(experiment, run_dir)]
    if case == "unknown key":
        args += ["--model.hiden", "3"]
    elif case == "wrong type in YAML":
        (tmp_path / "bad.yaml").write_text("trainer:\n  max_epochs: three\n")
        args += ["--config", str(tmp_path / "bad.yaml")]
    elif case == "data that cannot be read":  # the data module's own error, raised in its setup
        args += ["--data.train_size", "0"]
    elif case == "missing checkpoint":
        args += ["--ckpt_path", str(tmp_path / "nope.ckpt")]
    elif case == "not a checkpoint":
        (tmp_path / "notes.ckpt").write_text("not a checkpoint")
        args += ["--ckpt_path", str(tmp_path / "notes.ckpt")]
    else:
        write_malicious_checkpoint(tmp_path / "evil.ckpt", proof)
        assert zipfile.is_zipfile(tmp_path / "evil.ckpt")
        args += ["--ckpt_path", str(tmp_path / "evil.ckpt")]

    result = run_train(*args)
    assert result.returncode != 0
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and message in error_lines[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not proof.exists(), "loading the checkpoint ran its code"
    assert not list(run_dir.rglob("*.ckpt")), "a checkpoint a later resume would pick up"


def test_no_secret_reaches_logs_configs_or_checkpoints(experiment, tmp_path):
    secret = "fake-wandb-key-" + "7f3a" * 8
    env = clean_env(WANDB_API_KEY=secret, AWS_SECRET_ACCESS_KEY=secret)
    del env["WANDB_MODE"]  # let the project choose: a key but no reachable server -> offline
    result = run_train("fit", *quick_run_args(experiment, tmp_path / "run"), env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "logs offline" in result.stderr
    assert secret not in result.stdout + result.stderr
    written = [path for path in (tmp_path / "run").rglob("*") if path.is_file()]
    assert any(path.suffix == ".ckpt" for path in written) and any(path.name == "config.yaml" for path in written)
    for path in written:
        assert secret.encode() not in path.read_bytes(), f"{path} holds the key"


def test_checkpoints_load_without_running_code(tmp_path):
    # What `--ckpt_path` relies on, checked directly: the atomic checkpoint IO loads with weights_only.
    from trainkit.checkpoints.io import AtomicCheckpointIO
    from trainkit.run.errors import ConfigError

    proof = tmp_path / "code-ran"
    write_malicious_checkpoint(tmp_path / "evil.ckpt", proof)
    with pytest.raises(ConfigError, match="refused to load"):
        AtomicCheckpointIO().load_checkpoint(tmp_path / "evil.ckpt")
    assert not proof.exists()
    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "evil.ckpt", weights_only=True)


def test_lost_processes_are_named_by_their_nodes():
    from trainkit.run.placement import Placement, nodes_of

    placement = [Placement(node_rank=rank // 2, global_rank=rank, host=f"test-{rank // 2}") for rank in range(4)]
    assert nodes_of([2, 3], placement) == "node 1 (host test-1, global ranks 2, 3)"
    assert nodes_of([1], placement) == "node 0 (host test-0, global ranks 0, 1; rank 1 did not answer)"
    both = (
        "node 0 (host test-0, global ranks 0, 1; rank 0 did not answer)"
        " and node 1 (host test-1, global ranks 2, 3; rank 3 did not answer)"
    )
    assert nodes_of([0, 3], placement) == both
    assert nodes_of([], placement) == ""


def test_a_survivor_that_finds_the_roll_call_over_blames_no_node():
    """The roll call lives in node 0's first process: a process that noticed the loss after the others ended
    (it waited out cluster.timeout) cannot tell a dead node 0 from one that ended, and says both."""
    from types import SimpleNamespace

    from trainkit.run.diagnostics import explain
    from trainkit.run.lost_peers import WhoIsMissing
    from trainkit.run.placement import Placement

    placement = [Placement(node_rank=rank // 2, global_rank=rank, host=f"test-{rank // 2}") for rank in range(4)]
    environment = SimpleNamespace(main_address="test-0", main_port=29500)
    trainer = SimpleNamespace(strategy=SimpleNamespace(cluster_environment=environment), num_devices=2,
                              node_rank=0, global_rank=1)  # fmt: skip
    line = explain(RuntimeError("Timed out waiting 20000ms"), trainer, timedelta(seconds=20), placement, None)
    assert line == (
        "error: node 0 (global rank 1) lost contact with the other processes of the job (RuntimeError); the main node"
        " (test-0:29500) no longer answers: node 0 died or was stopped, or its processes had already ended after"
        " losing another one: see the other nodes' logs."
    )
    named = explain(RuntimeError("gloo"), trainer, timedelta(seconds=20), placement, WhoIsMissing([2, 3]))
    assert named.endswith("node 1 (host test-1, global ranks 2, 3) probably died or was stopped: see its log.")
    stuck = explain(RuntimeError("gloo"), trainer, timedelta(seconds=20), placement,
                    WhoIsMissing([], {3: "/src/model.py:42 in training_step"}))  # fmt: skip
    assert "stuck: global rank 3 (node 1, host test-1) at /src/model.py:42 in training_step. It still answers" in stuck
    everyone = explain(RuntimeError("gloo"), trainer, timedelta(seconds=20), placement, WhoIsMissing([]))
    assert everyone.endswith(
        "every process still answers, so one is stuck (a peer stopped answering): see whose log ends first."
    )
