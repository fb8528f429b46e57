"""Data loader workers start from a process with threads; one stuck in its fork ends the job with 75, never a hang."""

import re
import subprocess
import sys
import time
import warnings

import pytest

from trainkit.run import worker_start
from trainkit.run.worker_start import fork_can_hang
from trainkit.testing import runs

from .drills import full_epochs_args, process_tree
from .helpers import PROJECT_ROOT, clean_env, quick_run_args, run_train

pytestmark = pytest.mark.slow


def test_a_worker_stuck_in_its_fork_ends_the_job_with_75_and_names_it(experiment, tmp_path):
    command = [sys.executable, str(PROJECT_ROOT / "train_with_stuck_forks.py"), "fit",
               *full_epochs_args(experiment, tmp_path / "run"), "--data.num_workers", "2"]  # fmt: skip
    started = time.monotonic()
    run = subprocess.Popen(command, cwd=PROJECT_ROOT, env=clean_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    try:
        output, _ = run.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        for pid in process_tree(run.pid):
            subprocess.run(["kill", "-9", str(pid)], check=False)
        pytest.fail("the job hung on its stuck workers")
    assert run.returncode == 75, output[-3000:]
    assert time.monotonic() - started < 90
    line = output.strip().splitlines()[-1]
    assert line.startswith("error: a data loader worker of this process") and "did not start within 5 s" in line, (
        output[-3000:]
    )
    assert "(pid " in line.partition("of its fork")[2]  # the stuck worker named
    assert runs.ended_for_a_stuck_fork(subprocess.CompletedProcess(command, 75, stderr=output)) is fork_can_hang()
    # Where it was stuck, printed by the worker itself: on the lock (here, the sleep) that held it.
    stack = output.partition("the stack of data loader worker")[2]
    assert re.search(r'File ".*train_with_stuck_forks.py", line \d+ in <lambda>', stack), output[-3000:]


def test_two_process_fits_with_loader_workers_start_every_worker(experiment, tmp_path):
    # Workers forked from processes with threads (gloo's, wandb's, the kit's), one fit after another.
    for attempt in range(3):
        result = run_train("fit", *quick_run_args(experiment, tmp_path / f"run{attempt}"), "--trainer.devices", "2",
                           "--data.num_workers", "2", timeout=240)  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        assert "did not start" not in result.stderr


@pytest.mark.parametrize(("version", "can_hang"), [((3, 11, 7), True), ((3, 11, 9), True), ((3, 11, 10), False),
                                                 ((3, 12, 0), False), ((3, 13, 1), False)])  # fmt: skip
def test_the_pythons_whose_own_fork_can_hang_the_child_are_known(version, can_hang):
    assert fork_can_hang(version) is can_hang


@pytest.mark.parametrize(("world_size", "workers", "warned"), [(2, 2, True), (1, 2, False), (2, 0, False)])
def test_a_job_of_several_processes_with_loader_workers_on_such_a_python_is_warned(monkeypatch, world_size, workers,
                                                                                    warned):  # fmt: skip
    monkeypatch.setattr(worker_start, "fork_can_hang", lambda: True)
    monkeypatch.setattr(worker_start, "python_named", lambda: "Python 3.11.7")
    warning = worker_start.stuck_fork_warning(world_size, workers)
    if warned:
        assert warning.startswith("Python 3.11.7 can leave a data loader worker hung") and "112275" in warning
    else:
        assert warning is None
    monkeypatch.setattr(worker_start, "fork_can_hang", lambda: False)
    assert worker_start.stuck_fork_warning(world_size, workers) is None


def test_a_process_that_forks_keeps_its_own_sigusr2_handler():
    # Each fork hands the child a stack printer on SIGUSR2; the parent's own handler stays as it was.
    script = """
import os, signal
from trainkit.run.worker_start import watch_worker_starts
watch_worker_starts()
signal.signal(signal.SIGUSR2, lambda *_: print("own handler"))
child = os.fork()
if child == 0:
    os._exit(0)
os.waitpid(child, 0)
os.kill(os.getpid(), signal.SIGUSR2)
"""
    result = subprocess.run([sys.executable, "-c", script], env=clean_env(), capture_output=True, text=True,
                            timeout=60)  # fmt: skip
    assert result.returncode == 0 and result.stdout == "own handler\n", result.stderr


# How a job's first attempt ends with 75: by the worker-start watchdog's own line, or for another cause.
FIRST_ATTEMPT_ENDS = {
    "stuck fork": "from trainkit.run import worker_start; worker_start._end_the_job([])",
    "lost peer": "print('error: node 1 lost contact with the other processes', file=sys.stderr); sys.exit(75)",
}


@pytest.mark.parametrize("cause", FIRST_ATTEMPT_ENDS)
def test_the_suites_run_a_job_again_only_where_a_worker_hung_in_pythons_own_fork(tmp_path, cause):
    # run_train, which the kit's and a project's tests run train.py with, retries as a platform would, but only
    # where the Python in use has that bug: elsewhere a worker that never started fails the test.
    (tmp_path / "train.py").write_text(
        "import sys\nfrom pathlib import Path\n"
        "attempts = Path('attempts')\nattempts.write_text(attempts.read_text() + 'x' if attempts.exists() else 'x')\n"
        f"if attempts.read_text() == 'x': {FIRST_ATTEMPT_ENDS[cause]}\n"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = runs.run_train(tmp_path, env=clean_env(), timeout=60)
    again = cause == "stuck fork" and fork_can_hang()
    attempts = (tmp_path / "attempts").read_text()
    assert (result.returncode, attempts) == ((0, "xx") if again else (75, "x")), result.stderr
    assert [str(warning.message) for warning in caught] == (
        [f"a data loader worker hung in its fork ({worker_start.FORK_BUG}): the job ran again"] if again else []
    )
