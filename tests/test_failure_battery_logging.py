"""The failure battery, logging: a wandb server that fails never stops training.

Each case points the default generated project at a stand-in wandb server on 127.0.0.1
(tests/wandb_server.py) with an API key, as a logged-in user's run would be, and trains a few
steps on the real digits. Before, a server that failed this way held the run for 96-108 s and
ended it with exit 1. Promised: exit 0 within seconds, one line that says what failed and the
`wandb sync` command that uploads the run later, the run's record on disk under the run id kept
beside the checkpoints, and the checkpoints.
"""

from pathlib import Path

import pytest

from .battery import Ending, run_project
from .launch_runs import launch_environment, quick_cpu_run
from .wandb_server import ERRORS, FAILS_MID_RUN, REFUSES_RUNS, SILENT, WandbServer

WITHIN = 60  # seconds, the run included, on a busy 2-core machine
FAKE_KEY = "fake-wandb-key-" + "0123456789" * 4


def against(server: WandbServer, project: Path) -> dict[str, str]:
    """A logged-in user's environment whose wandb server is `server`, and nothing but 127.0.0.1 to reach."""
    env = launch_environment(project)
    env = {name: value for name, value in env.items() if not name.startswith("WANDB_")}  # WANDB_MODE among them
    env.update(WANDB_BASE_URL=server.url, WANDB_API_KEY=FAKE_KEY, NETRC="/nonexistent",
               NO_PROXY="127.0.0.1", no_proxy="127.0.0.1")  # fmt: skip
    return env


def train(project: Path, server: WandbServer, digits: Path, out: Path, *more: str) -> Ending:
    args = ["fit", "--config", "configs/experiment.yaml", *quick_cpu_run(digits, out), *more]
    return run_project(project, *args, env=against(server, project), timeout=WITHIN + 60)


def assert_trained_on(ending: Ending, server: WandbServer, said: str, out: Path) -> Path:
    """Exit 0 in time, checkpoints, one line naming the server with `said` and `wandb sync DIR`; DIR."""
    assert ending.code == 0, ending.tail()
    assert ending.seconds < WITHIN, ending.tail()
    assert "Traceback" not in ending.stderr, ending.tail()
    assert server.requests, "the run never asked the server"
    reports = [line for line in (ending.stdout + ending.stderr).splitlines() if line.startswith(f"wandb: {server.url}")]
    assert len(reports) == 1 and said in reports[0], ending.tail()
    checkpoints = out / "run" / "checkpoints"
    assert (checkpoints / "last.ckpt").is_file(), ending.tail()
    # The record to upload later, under the same run id as before the failure and after a restart.
    synced = sorted(Path("/").glob(reports[0].split("wandb sync ")[1].strip().lstrip("/")))
    run_id = (checkpoints / "wandb-run-id").read_text().strip()
    assert len(synced) == 1 and synced[0].name.endswith(f"-{run_id}"), reports[0]
    assert (synced[0] / f"run-{run_id}.wandb").stat().st_size > 0
    return synced[0]


@pytest.mark.parametrize(
    ("behaviour", "said"),
    [
        (ERRORS, "answered HTTP 500, so this run logs offline"),
        (SILENT, "did not answer within 5 s, so this run logs offline"),
    ],
    ids=["errors", "silent"],
)
def test_a_server_that_fails_at_the_start_leaves_the_run_offline_at_once(
    default_project, real_mnist, tmp_path, behaviour, said
):
    with WandbServer(behaviour) as server:
        # Two processes: only global rank 0 says it.
        ending = train(default_project, server, real_mnist, tmp_path, "--trainer.devices", "2")
    synced = assert_trained_on(ending, server, said, tmp_path)
    assert synced.name.startswith("offline-run-")
    assert len(server.requests) == 1, f"asked once, then left alone: {server.requests}"


def test_a_server_that_will_not_create_the_run_leaves_it_offline(default_project, real_mnist, tmp_path):
    with WandbServer(REFUSES_RUNS) as server:
        ending = train(default_project, server, real_mnist, tmp_path)
    synced = assert_trained_on(ending, server, "failed (", tmp_path)
    assert synced.name.startswith("offline-run-")
    assert any("UpsertBucket" in request for request in server.refused), server.requests


def test_a_server_that_fails_mid_run_keeps_the_rest_on_disk(default_project, real_mnist, tmp_path):
    with WandbServer(FAILS_MID_RUN) as server:
        ending = train(default_project, server, real_mnist, tmp_path)
    synced = assert_trained_on(ending, server, "did not take all of this run", tmp_path)
    assert synced.name.startswith("run-"), "the online run's own record"
    assert "POST /graphql UpsertBucket" in server.requests[: server.requests.index(server.refused[0])]
    assert any("file_stream" in request for request in server.refused), "it failed while the run was uploading"
