"""The local-disk side of `ArtifactStore`: publish by one atomic folder rename, delete by a rename aside, sweep.

Functions of a store whose root is a local folder; `store.py` calls them and keeps the checks common to both sides.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from posttrain_core.artifacts import fsio
from posttrain_core.artifacts.manifest import manifest_bytes
from posttrain_core.artifacts.ref import DELETED, MANIFEST, TMP_PREFIX, ArtifactRef, incomplete_message

if TYPE_CHECKING:
    from posttrain_core.artifacts.store import ArtifactStore

logger = logging.getLogger(__name__)


def publish(
    store: ArtifactStore, key: str, kind: str, src: Path, extra: Mapping, schema_kind: str | None
) -> ArtifactRef:
    """Move `src`'s content into a temp folder beside the target, digest and fsync it, write the manifest, rename."""
    target = Path(store._target(key))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f"{TMP_PREFIX}{key}-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        fsio.move_contents(src, tmp)  # a rename when staging and store share a disk (the default)
        # The content files are flushed to disk while the digest reads them: both wait on I/O, so overlapping them
        # takes about half the time of doing one after the other.
        with ThreadPoolExecutor(1, thread_name_prefix="fsync") as pool:
            flushed = pool.submit(lambda: [fsio.fsync(path) for _, path in fsio.content_files(tmp)])
            manifest = manifest_bytes(key, kind, schema_kind, tmp, extra)
            flushed.result()
        fsio.write_synced(tmp / MANIFEST, manifest)
        for dirpath, _, _ in os.walk(tmp, topdown=False):
            fsio.fsync(Path(dirpath))
        try:
            os.rename(tmp, target)  # atomic; fails on a non-empty target, so a winner is never replaced
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            existing = store.get(key)
            if existing is None:
                raise FileExistsError(incomplete_message(key, str(target))) from e
            shutil.rmtree(tmp, ignore_errors=True)
            logger.info("artifact %s was published concurrently; discarded our copy", key)
            fsio.remove_empty(src)
            return existing
    except BaseException:
        fsio.restore(tmp, src)
        raise
    fsio.fsync(target.parent)
    fsio.remove_empty(src)
    logger.info("published %s %s at %s", kind, key, target)
    ref = store.get(key)
    if ref is None:  # cannot happen after a successful rename; guard against a foreign delete
        raise FileNotFoundError(f"artifact {key} vanished from {target} right after publishing")
    return ref


def remove(target: Path, key: str) -> bool:
    """Rename an artifact folder aside (`get()` misses it from then on), then remove it; False when a concurrent
    delete renamed it first."""
    doomed = target.parent / f"{TMP_PREFIX}{key}-del-{uuid.uuid4().hex}"
    try:
        os.rename(target, doomed)
    except FileNotFoundError:
        return False
    fsio.fsync(doomed.parent)
    shutil.rmtree(doomed, ignore_errors=True)
    return True


def write_tombstone(path: Path, key: str, body: bytes) -> None:
    """Replace a tombstone file atomically (write a temp file, fsync, rename)."""
    folder = path.parent
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f"{TMP_PREFIX}{key}-{uuid.uuid4().hex}"
    fsio.write_synced(tmp, body)
    os.replace(tmp, path)
    fsio.fsync(folder)


def sweep(store: ArtifactStore, max_age_s: float) -> int:
    """Remove `.tmp-*` folders of the store and of the download cache older than `max_age_s`, and every folder a
    crashed delete left (`.tmp-{key}-del-*`, at any age); return how many."""
    now = time.time()
    removed = 0
    in_store = list((Path(store._root) / "artifacts").glob(f"*/{TMP_PREFIX}*"))
    deleted = {tmp for tmp in in_store if DELETED.match(tmp.name)}
    for tmp in in_store + list(store.cache_root.glob(f"{TMP_PREFIX}*")):
        try:
            age = now - tmp.stat().st_mtime
        except FileNotFoundError:
            continue
        if age >= max_age_s or tmp in deleted:
            shutil.rmtree(tmp, ignore_errors=True)
            if not os.path.lexists(tmp):
                removed += 1
                logger.info("swept %s (%.0f s old)", tmp, age)
    return removed
