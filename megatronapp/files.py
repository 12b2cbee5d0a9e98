"""Atomic file writes: the one way the project writes a file (checkpoints, timelines, reports,
exports, captures, summaries).

A file is written under a temporary name in the same directory and renamed over the target
only once it is complete (`os.replace` is atomic within a filesystem), so a reader never sees
half a file and a failed or interrupted write leaves the old file untouched and no debris.
The temporary name is unique (two writers of one target do not collide), ends in the target's
suffix (tools that infer the format from the name, e.g. matplotlib, still work), and the final
file gets the permissions a plain open() would give (0666 minus the umask), not the 0600 of
tempfile.mkstemp.

    with atomic_path("out/timeline.json") as tmp:
        write_everything_to(tmp)
    write_text_atomic("run/summary.json", text)
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


def _read_umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it; done once, at import
    os.umask(mask)
    return mask


_FILE_MODE = 0o666 & ~_read_umask()


def temp_path_beside(path: str | os.PathLike) -> Path:
    """A new empty file with a unique name next to `path` (its directory is created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=f".tmp{path.suffix}", dir=path.parent)
    os.close(fd)
    return Path(tmp)


def commit_temp(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Give the finished temporary file `tmp` ordinary permissions and rename it over `path`."""
    os.chmod(tmp, _FILE_MODE)
    os.replace(tmp, path)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path to write `path`'s content to; it becomes `path` when the block ends
    without an exception, and is removed otherwise."""
    tmp = temp_path_beside(path)
    try:
        yield tmp
        commit_temp(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def check_writable_path(path: str | os.PathLike, flag: str) -> None:
    """Before a command starts: `path` names a file, not a folder, and its folder exists or can be
    made (the writers make missing folders); ValueError (one line naming `flag`) otherwise."""
    target = Path(path).resolve()
    if target.is_dir():
        raise ValueError(f"{flag} {path} is a folder; give a file name")
    existing = next(p for p in target.parents if p.exists())
    if not existing.is_dir():
        raise ValueError(f"{flag} {path}: {existing} is a file, so the folder cannot be made")
