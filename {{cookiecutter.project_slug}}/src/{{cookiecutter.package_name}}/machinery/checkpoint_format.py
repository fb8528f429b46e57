"""Sharded checkpoints: a directory that counts only once every process's part of it is written.

The sharded strategy (sharded.py) saves a checkpoint as a directory `NAME.ckpt/` holding one
`__<rank>_0.distcp` file per process (its shard of the weights and optimizer state), `.metadata`
(where each tensor's pieces are, written by torch.distributed.checkpoint) and `meta.pt` (the rest:
step, loops, callbacks, provenance). torch keeps no checksums and rewrites these files in place,
so a process killed during a save could leave shards of two different steps that load without a
word. Here a save goes into a fresh hidden directory; once every file is written the first process
adds `COMMITTED`, which lists every file and its size, and renames the directory into place.
A directory without it, or whose files differ from it, is not a checkpoint.
"""

import json
import os
from pathlib import Path
from typing import Any

import torch

COMMIT_MARKER = "COMMITTED"
META_FILE = "meta.pt"  # Lightning's name for the part that is not sharded


def is_sharded(path: str | Path) -> bool:
    return Path(path).is_dir()


def commit(directory: Path, step: int, world_size: int) -> None:
    """Mark `directory` complete: every file it holds now, with its size, then fsync it all."""
    files = {file.name: file.stat().st_size for file in sorted(directory.iterdir()) if file.is_file()}
    for name in files:
        _fsync(directory / name)
    marker = {"step": step, "world_size": world_size, "files": files}
    partial = directory / f".{COMMIT_MARKER}.partial"
    partial.write_text(json.dumps(marker, indent=1))
    _fsync(partial)
    os.replace(partial, directory / COMMIT_MARKER)
    _fsync(directory)


def sharded_damage(directory: Path) -> str | None:
    """What is wrong with the sharded checkpoint `directory`, or None when it is whole."""
    try:
        marker = json.loads((directory / COMMIT_MARKER).read_text())
        files = marker["files"]
    except FileNotFoundError:
        return f"it has no {COMMIT_MARKER} marker: its save did not finish"
    except (ValueError, KeyError, TypeError) as error:
        return f"its {COMMIT_MARKER} marker is unreadable ({error})"
    for name, size in files.items():
        try:
            found = (directory / name).stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        if found != size:
            return f"{name} holds {found} bytes, not the {size} it was saved with"
    return None


def checkpoint_meta(path: str | Path) -> dict[str, Any]:
    """A checkpoint's state other than the tensors (global_step, callbacks, provenance), file or directory."""
    path = Path(path)
    source = path / META_FILE if path.is_dir() else path
    return torch.load(source, weights_only=True, mmap=True, map_location="cpu")


def checkpoint_size(path: str | Path) -> int:
    """Bytes on disk: the file's, or the sum of a sharded checkpoint's files."""
    path = Path(path)
    if not path.is_dir():
        return path.stat().st_size
    return sum(file.stat().st_size for file in path.iterdir() if file.is_file())


def _fsync(path: Path) -> None:
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)
