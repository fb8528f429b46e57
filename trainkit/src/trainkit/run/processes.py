"""This machine's processes as Linux lists them in /proc."""

from pathlib import Path


def children_of(parent: int) -> list[int]:
    """The running processes whose parent is `parent`."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # the parent's id is the second field after the command name, which may hold spaces
            if int(stat.read_text().rpartition(")")[2].split()[1]) == parent:
                children.append(int(stat.parent.name))
        except (OSError, ValueError):
            continue  # ended meanwhile
    return children
