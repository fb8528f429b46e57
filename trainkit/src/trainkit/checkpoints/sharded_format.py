"""Sharded checkpoints: a directory that counts only once every process's part of it is written.

The sharded strategy (strategies/sharded.py) saves a checkpoint as a directory `NAME.ckpt/` holding one
`__<rank>_0.distcp` file per process (its shard of the weights and optimizer state), `.metadata`
(where each tensor's pieces are, written by torch.distributed.checkpoint) and `meta.pt` (the rest:
step, loops, callbacks, provenance). torch keeps no checksums and rewrites these files in place,
so a process killed during a save could leave shards of two different steps that load without a
word. Here a save goes into a fresh hidden directory; once every file is written the first process
adds `COMMITTED`, which lists every file and its size, and renames the directory into place.
A directory without it, or whose files differ from it, is not a checkpoint.

Runs without the sharded strategy (one device, DDP) load one file. Converted into one, with the
weights, the optimizer's state and the rest, a sharded checkpoint resumes or tests anywhere:
`python -m trainkit.checkpoints.sharded_format checkpoints/last.ckpt one-file.ckpt`
(torch's own `format_utils dcp_to_torch` leaves out meta.pt, which Lightning needs).
"""

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from trainkit.checkpoints.io import fsync
from trainkit.run.exit_codes import CONFIG_ERROR

COMMIT_MARKER = "COMMITTED"
META_FILE = "meta.pt"  # Lightning's name for the part that is not sharded
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's: where each tensor's pieces are


def is_sharded(path: str | Path) -> bool:
    return Path(path).is_dir()


def commit(directory: Path, step: int, world_size: int) -> None:
    """Mark `directory` complete: every file it holds now, with its size, then fsync it all."""
    files = {file.name: file.stat().st_size for file in sorted(directory.iterdir()) if file.is_file()}
    for name in files:
        fsync(directory / name)
    marker = {"step": step, "world_size": world_size, "files": files}
    partial = directory / f".{COMMIT_MARKER}.partial"
    partial.write_text(json.dumps(marker, indent=1))
    fsync(partial)
    os.replace(partial, directory / COMMIT_MARKER)
    fsync(directory)


def sharded_damage(directory: Path) -> str | None:
    """What is wrong with the sharded checkpoint `directory`, or None when it is whole."""
    try:
        marker = json.loads((directory / COMMIT_MARKER).read_text())
        files = marker["files"]
    except FileNotFoundError:
        return f"it has no {COMMIT_MARKER} marker: its save did not finish"
    except (ValueError, KeyError, TypeError) as error:
        return f"its {COMMIT_MARKER} marker is unreadable ({error})"
    for name in (DCP_METADATA, META_FILE):
        if name not in files:
            return f"its {COMMIT_MARKER} marker lists no {name}"
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


def to_one_file(directory: Path, out: Path) -> None:
    """Write the sharded checkpoint `directory` as one file, as Lightning saves without the sharded strategy.

    The whole checkpoint is gathered in this process's memory.
    """
    with tempfile.TemporaryDirectory(dir=out.parent) as scratch:
        tensors = Path(scratch, "tensors.pt")
        dcp_to_torch_save(directory, tensors)  # {"state_dict": ..., "optimizer_0": ...}, every shard joined
        checkpoint = torch.load(tensors, weights_only=True, map_location="cpu")
    checkpoint.update(checkpoint_meta(directory))
    # The sharded strategy saves each optimizer's state under a key of its own, Lightning's files as a list.
    optimizers = sorted((key for key in checkpoint if re.fullmatch(r"optimizer_\d+", key)), key=_number)
    checkpoint["optimizer_states"] = [checkpoint.pop(key) for key in optimizers]
    torch.save(checkpoint, out)


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Convert a sharded checkpoint (a directory) into one file.")
    parser.add_argument("checkpoint", type=Path, help="the sharded checkpoint: a directory NAME.ckpt")
    parser.add_argument("out", type=Path, help="the file to write")
    options = parser.parse_args(args)
    problem = sharded_damage(options.checkpoint) if is_sharded(options.checkpoint) else "it is not a directory"
    if problem is not None:
        print(f"error: {options.checkpoint} is not a whole sharded checkpoint: {problem}", file=sys.stderr)
        sys.exit(CONFIG_ERROR)
    to_one_file(options.checkpoint, options.out)
    print(f"wrote {options.out}")


def _number(key: str) -> int:
    return int(key.removeprefix("optimizer_"))


if __name__ == "__main__":
    main()
