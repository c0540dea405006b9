"""Local-disk primitives of the store: listing a folder's files, fsync, early writeback, moving content in and out.

Only `os`/`shutil` calls (looked up at call time, so tests can patch them); no store logic.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import sys
from pathlib import Path

from posttrain_core.artifacts.ref import MANIFEST

logger = logging.getLogger(__name__)


def walk_files(folder: Path) -> list[tuple[str, Path]]:
    """Sorted (relative POSIX path, path) of every file under `folder` (symlinked files followed)."""
    out = []
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            path = Path(dirpath, name)
            out.append((path.relative_to(folder).as_posix(), path))
    return sorted(out)


def content_files(folder: Path) -> list[tuple[str, Path]]:
    """`walk_files` without the top-level manifest.json: an artifact's content."""
    return [(rel, path) for rel, path in walk_files(folder) if rel != MANIFEST]


def move_contents(src: Path, dst: Path) -> None:
    for child in sorted(src.iterdir()):
        shutil.move(str(child), str(dst / child.name))


def restore(tmp: Path, src: Path) -> None:
    """After a failed publish, move the content back to `src`, so that a retry can publish it."""
    try:
        if not tmp.exists():
            return
        (tmp / MANIFEST).unlink(missing_ok=True)
        src.mkdir(parents=True, exist_ok=True)
        move_contents(tmp, src)
        tmp.rmdir()
    except OSError:
        logger.warning("publish failed; could not move %s back to %s (sweep() removes it)", tmp, src, exc_info=True)


def remove_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:
        pass


def fsync(path: Path) -> None:
    """fsync a file or a folder (a folder's entry list must be durable too before the rename)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, body: bytes) -> None:
    """Write a small file (a manifest, a tombstone) and fsync it."""
    with open(path, "wb") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())


def start_writeback(folder: str | os.PathLike) -> None:
    """Ask the kernel to start writing the dirty pages of a folder's files (or of one file) to disk now, without
    waiting: Linux `sync_file_range(SYNC_FILE_RANGE_WRITE)`, nothing elsewhere. A stage that writes a large file
    some time before it publishes calls it, so that the disk works while the stage does, and the publish's fsync
    finds most of the bytes on disk already. Never raises: it only changes when the bytes reach the disk, not
    whether (the publish fsyncs them all the same)."""
    sync_file_range = _sync_file_range()
    if sync_file_range is None:
        return
    root = Path(folder)
    for path in [root] if root.is_file() else [p for _, p in walk_files(root)]:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            sync_file_range(fd, 0, 0, 2)  # SYNC_FILE_RANGE_WRITE: start writeback of the whole file
        finally:
            os.close(fd)


@functools.cache
def _sync_file_range():
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    import ctypes.util

    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn
