"""A machine's copies of a remote store's artifacts (`{cache_root}/{key}`, made by `ArtifactStore.local_path`): kept
within a size bound, and dropped once the store no longer has the artifact.

Each machine that reads from a remote store (the flow's, and every Ray node's) keeps its own copies. `trim` applies
the store's own rules to them: a copy of an artifact the store deleted (`posttrain artifacts gc`, on any machine) goes;
a download a kill interrupted (a `.tmp-*` folder, never read as complete) goes; then the least recently used copies go
until the cache fits its bound. A copy is "used" when `local_path` returns it (its manifest's mtime is touched), and
one used in the last `min_idle_s` seconds is kept whatever the bound: a stage on this machine may be reading it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from posttrain_core.artifacts.manifest import content_bytes
from posttrain_core.artifacts.ref import MANIFEST, TMP_PREFIX, check_key

if TYPE_CHECKING:
    from posttrain_core.artifacts.store import ArtifactStore

logger = logging.getLogger(__name__)

# The bound when $POSTTRAIN_CACHE_GB is unset. It sizes a disk, not a result: an evicted copy is downloaded again.
DEFAULT_CACHE_GB = 100.0
MIN_IDLE_S = 600.0


def cache_bound_bytes() -> int:
    """$POSTTRAIN_CACHE_GB (a machine's setting, like its disk) in bytes, else `DEFAULT_CACHE_GB`.

    Raises:
        ValueError: the variable is not a positive number (names it).
    """
    from posttrain_core.env import setting

    raw = (setting("POSTTRAIN_CACHE_GB") or "").strip()
    if not raw:
        return int(DEFAULT_CACHE_GB * 2**30)
    try:
        gb = float(raw)
    except ValueError:
        gb = -1.0
    if gb <= 0:
        raise ValueError(f"$POSTTRAIN_CACHE_GB={raw!r}: expected a positive number of GiB")
    return int(gb * 2**30)


def touch(copy: Path) -> None:
    """Mark a cached copy as used now (its manifest's mtime)."""
    try:
        os.utime(copy / MANIFEST)
    except FileNotFoundError:
        pass


def _size(manifest: Path) -> int:
    """A copy's bytes, as its manifest lists them (no walk over its files)."""
    return content_bytes(json.loads(manifest.read_text()))


@dataclass
class TrimReport:
    """What `trim` removed, by reason (keys or folder names), and the bytes left."""

    deleted_in_store: list[str] = field(default_factory=list)
    interrupted: list[str] = field(default_factory=list)
    evicted: list[str] = field(default_factory=list)
    kept_bytes: int = 0


def trim(
    store: ArtifactStore, max_bytes: int | None = None, min_idle_s: float = MIN_IDLE_S, check_store: bool = True
) -> TrimReport:
    """Bring this machine's cache of `store` within `max_bytes` (default `cache_bound_bytes()`); see the module.

    Args:
        min_idle_s: copies used more recently are never evicted for size, and `.tmp-*` downloads younger than this
            are left to the download that may own them.
        check_store: also drop copies of artifacts the store no longer has (one manifest read per copy; after each
            download only the bound is applied).
    """
    bound = cache_bound_bytes() if max_bytes is None else max_bytes
    report = TrimReport()
    root = store.cache_root
    if not root.is_dir():
        return report
    now = time.time()
    copies: list[tuple[float, int, Path]] = []  # (last use, bytes, folder)
    for entry in root.iterdir():
        if not entry.is_dir():
            continue
        if entry.name.startswith(TMP_PREFIX):
            if now - entry.stat().st_mtime >= min_idle_s:
                shutil.rmtree(entry, ignore_errors=True)
                report.interrupted.append(entry.name)
            continue
        try:
            check_key(entry.name)
        except ValueError:
            continue  # not ours
        manifest = entry / MANIFEST
        if not manifest.exists() or (check_store and store.get(entry.name) is None):
            shutil.rmtree(entry, ignore_errors=True)
            report.deleted_in_store.append(entry.name)
            continue
        copies.append((manifest.stat().st_mtime, _size(manifest), entry))
    total = sum(size for _, size, _ in copies)
    for used, size, folder in sorted(copies, key=lambda c: c[0]):  # least recently used first
        if total <= bound:
            break
        if now - used < min_idle_s:
            continue
        shutil.rmtree(folder, ignore_errors=True)
        report.evicted.append(folder.name)
        total -= size
    report.kept_bytes = total
    if report.deleted_in_store or report.interrupted or report.evicted:
        logger.info(
            "cache %s: removed %d copies of deleted artifacts, %d interrupted downloads, evicted %d (least recently "
            "used); %.2f GiB kept of a %.2f GiB bound",
            root, len(report.deleted_in_store), len(report.interrupted), len(report.evicted), total / 2**30,
            bound / 2**30,
        )  # fmt: skip
    return report
