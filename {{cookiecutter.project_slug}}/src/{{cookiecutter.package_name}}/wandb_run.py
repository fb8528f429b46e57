"""How the wandb logger runs: online when it can, offline otherwise, and the same run across restarts."""

import os
import secrets
import socket
from netrc import NetrcParseError, netrc
from pathlib import Path
from urllib.parse import urlparse

from jsonargparse import Namespace
from lightning.pytorch.utilities import rank_zero_info


def keep_wandb_run_id(logger: Namespace, checkpoints: Path) -> None:
    """Give the wandb logger the same run id each time the job restarts, kept beside the checkpoints."""
    if logger.init_args.get("id"):
        return
    id_file = checkpoints / "wandb-run-id"
    if not id_file.exists():
        checkpoints.mkdir(parents=True, exist_ok=True)
        # Several processes may get here at once: the first to link its id into place wins.
        candidate = checkpoints / f".wandb-run-id.{os.getpid()}"
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
    url = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    if not _has_wandb_key(url.hostname):
        reason = "no wandb API key (set WANDB_API_KEY or run `wandb login`)"
    elif not _reachable(url.hostname, url.port or (443 if url.scheme == "https" else 80)):
        reason = f"{url.hostname} cannot be reached"
    else:
        return
    os.environ["WANDB_MODE"] = "offline"
    rank_zero_info(
        f"wandb: {reason}, so this run logs offline to {save_dir}/wandb."
        f" Upload it later with: wandb sync {save_dir}/wandb/offline-run-*"
    )


def _has_wandb_key(host: str | None) -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc(os.environ.get("NETRC")).authenticators(host or "") is not None
    except (FileNotFoundError, NetrcParseError):
        return False


def _reachable(host: str | None, port: int, timeout: float = 3.0) -> bool:
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True
    except OSError:
        return False
