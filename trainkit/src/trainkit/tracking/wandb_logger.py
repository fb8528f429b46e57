"""How the wandb logger runs: online when it can, offline otherwise, and the same run across restarts."""

import base64
import json
import os
import secrets
import urllib.error
import urllib.request
from collections.abc import Mapping
from netrc import NetrcParseError, netrc
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import lightning.pytorch.loggers
from jsonargparse import Namespace
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only

from trainkit.checkpoints.io import hidden_name_beside
from trainkit.run.wandb_service import leave_wandb

if TYPE_CHECKING:
    from wandb.sdk.lib import RunDisabled
    from wandb.wandb_run import Run


class WandbLogger(lightning.pytorch.loggers.WandbLogger):
    """Lightning's WandbLogger, except that a wandb server or service that fails never stops training.

    wandb itself waits 90 s for a server to take a new run, then raises and the run ends; at the end it
    waits for every upload, however long. This logger says once what went wrong and how to upload the
    run later (`wandb sync`), and trains on. wandb also logs through a service process of its own
    (wandb-core), which can end alone: killed for memory, or stopped by a signal that Slurm sends to
    every process of a job. Each later call would raise; this logger says so once and logs nothing more.

    Args:
        init_timeout: Seconds to wait for the server to take the run; then it logs offline, same run id.
        finish_timeout: Seconds to wait for uploads at the end; what is left stays on disk. 0: no limit.
        **kwargs: The arguments of Lightning's WandbLogger and of `wandb.init`. Wandb `settings`, when
            given, are used instead of the two waits above.
    """

    def __init__(self, init_timeout: float = 20.0, finish_timeout: float = 20.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if self._wandb_init.get("anonymous") is None:
            del self._wandb_init["anonymous"]  # Lightning passes None, which wandb warns about on every run
        if self._wandb_init.get("settings") is None:
            # finish_timeout_raises: how `finalize` learns that the uploads were cut short.
            waits = {"init_timeout": init_timeout, "finish_timeout": finish_timeout, "finish_timeout_raises": True}
            self._wandb_init["settings"] = waits
        self._service_lost = False

    @property
    @rank_zero_experiment
    def experiment(self) -> "Run | RunDisabled":
        import wandb

        try:
            return super().experiment
        except (wandb.Error, TimeoutError) as error:  # TimeoutError: wandb's own wait on its service
            wandb.teardown()  # its service still holds the failed run's id
            self._wandb_init["mode"] = "offline"
            run = super().experiment
            rank_zero_info(
                f"wandb: {_server_url()} failed ({_first_line(error)}), so this run logs offline to"
                f" {self.save_dir}/wandb. Upload it later with: wandb sync {Path(run.dir).parent}"
            )
            return run

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if self._service_lost:
            return
        try:
            super().log_metrics(metrics, step)
        except ConnectionError as error:  # raised by every call once wandb-core has ended
            self._service_lost = True
            run_dir = Path(self.experiment.dir).parent
            leave_wandb()
            rank_zero_info(
                f"wandb's service ended ({type(error).__name__}: {_first_line(error)}), so this run logs nothing"
                f" more to wandb from step {step}. What it logged before is in {run_dir}; upload it with: wandb sync"
                f" {run_dir}"
            )

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if self._service_lost:
            return  # nothing can finish the run: wandb sync uploads what is on disk
        super().finalize(status)  # uploads checkpoints first when `log_model` asks for them
        if self._experiment is None:
            return
        # Finished here rather than when Python exits, to tell whether the server took everything;
        # a later use of the logger (`trainer.test` after `fit`) continues the same run.
        run, self._experiment = self._experiment, None
        self._wandb_init["id"] = self._id = run.id
        try:
            run.finish(exit_code=1 if status == "failed" else 0)
        except TimeoutError:
            run_dir = Path(run.dir).parent
            rank_zero_info(
                f"wandb: {_server_url()} did not take all of this run within {run.settings.finish_timeout:g} s;"
                f" the rest is kept in {run_dir}. Upload it later with: wandb sync {run_dir}"
            )


def _server_url() -> str:
    return os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def keep_wandb_run_id(logger: Namespace, checkpoints: Path) -> None:
    """Give the wandb logger the same run id each time the job restarts, kept beside the checkpoints."""
    if logger.init_args.get("id"):
        return
    id_file = checkpoints / "wandb-run-id"
    if not id_file.exists():
        checkpoints.mkdir(parents=True, exist_ok=True)
        # Several processes may get here at once: the first to link its id into place wins.
        candidate = hidden_name_beside(id_file)
        candidate.write_text(secrets.token_hex(4))  # wandb's own ids are 8 characters too
        try:
            os.link(candidate, id_file)
        except FileExistsError:
            pass
        finally:
            candidate.unlink()
    logger.init_args.id = id_file.read_text().strip()


def choose_wandb_mode(save_dir: str) -> None:
    """Log online when there is an API key and the server answers; otherwise offline. Never fail."""
    if "WANDB_MODE" in os.environ:
        return
    url = _server_url()
    key = _wandb_key(urlparse(url).hostname)
    reason = _server_problem(url, key) if key else "no wandb API key (set WANDB_API_KEY or run `wandb login`)"
    if reason is None:
        return
    os.environ["WANDB_MODE"] = "offline"
    rank_zero_info(
        f"wandb: {reason}, so this run logs offline to {save_dir}/wandb."
        f" Upload it later with: wandb sync {save_dir}/wandb/offline-run-*"
    )


def _wandb_key(host: str | None) -> str | None:
    """The API key from WANDB_API_KEY or, as `wandb login` leaves it, the netrc file."""
    if os.environ.get("WANDB_API_KEY"):
        return os.environ["WANDB_API_KEY"]
    try:
        login = netrc(os.environ.get("NETRC")).authenticators(host or "")
    except (FileNotFoundError, NetrcParseError):
        return None
    return login[2] if login else None


def _server_problem(url: str, key: str, timeout: float = 5.0) -> str | None:
    """What is wrong with the server, asked who the key belongs to as wandb asks first; None if it answered.

    A server that fails this way would hold wandb for minutes and then end the run.
    """
    request = urllib.request.Request(
        f"{url.rstrip('/')}/graphql",
        data=json.dumps({"query": "query Viewer { viewer { id } }", "operationName": "Viewer"}).encode(),
        headers={
            "Content-Type": "application/json",
            "Authorization": "Basic " + base64.b64encode(f"api:{key}".encode()).decode(),
        },
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout):
            return None
    except urllib.error.HTTPError as error:
        refused = " (the API key was refused)" if error.code in (401, 403) else ""
        return f"{url} answered HTTP {error.code}{refused}"
    except OSError as error:  # URLError too: no such host, connection refused, a timeout while connecting
        if isinstance(error, TimeoutError) or isinstance(getattr(error, "reason", None), TimeoutError):
            return f"{url} did not answer within {timeout:g} s"
        return f"{url} cannot be reached ({getattr(error, 'reason', error)})"
