"""The fsspec side of `ArtifactStore` (object stores, `memory://`...): publish without a folder rename, download and
verify into the local cache, sweep by modification time. `store.py` calls these functions for non-local roots.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import posixpath
import shutil
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fsspec

from posttrain_core.artifacts import fsio
from posttrain_core.artifacts.digest import content_digest
from posttrain_core.artifacts.manifest import describe, manifest_of, read_manifest
from posttrain_core.artifacts.ref import (
    MANIFEST,
    TMP_PREFIX,
    ArtifactRef,
    check_key,
    incomplete_message,
    local_path_of,
)

if TYPE_CHECKING:
    from posttrain_core.artifacts.store import ArtifactStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Uploaded:
    """Content uploaded into a store's temp folder for `key` (`upload`), not yet an artifact: `commit` publishes it.

    Picklable: a Ray worker on any node uploads its stage's output and returns this; the stage's driver commits it.
    """

    key: str
    tmp: str  # the temp folder, a path on the store's filesystem
    files: list[dict[str, Any]]  # the manifest's `files`
    digest: str


def publish(
    store: ArtifactStore, key: str, kind: str, src: Path, extra: Mapping, schema_kind: str | None
) -> ArtifactRef:
    """Upload `src` into a temp folder beside the target, then commit it (manifest last); `src` is removed."""
    ref = commit(store, kind, upload(store, key, src), extra, schema_kind)
    shutil.rmtree(src, ignore_errors=True)
    return ref


def upload(store: ArtifactStore, key: str, src: Path) -> Uploaded:
    """Digest `src` and copy its content into a new temp folder beside the target of `key` (`sweep` removes it if
    nothing commits it)."""
    fs = store.fs
    tmp = f"{posixpath.dirname(store._target(key))}/{TMP_PREFIX}{key}-{uuid.uuid4().hex}"
    files, digest = describe(src)
    try:
        for folder in sorted({posixpath.dirname(f"{tmp}/{f['path']}") for f in files} | {tmp}):
            fs.makedirs(folder, exist_ok=True)
        for f in files:
            fs.put_file(str(src / f["path"]), f"{tmp}/{f['path']}")
    except BaseException:
        discard(fs, tmp)
        raise
    return Uploaded(key, tmp, files, digest)


def commit(
    store: ArtifactStore, kind: str, up: Uploaded, extra: Mapping, schema_kind: str | None
) -> ArtifactRef:
    """Publish uploaded content: its manifest into the temp folder, then the files moved onto the target one by one,
    the manifest last (object stores have no atomic rename; `get()` requires the manifest, so it never sees a
    partial artifact). When another publisher got there first, the temp folder goes and theirs is returned."""
    fs, key, tmp = store.fs, up.key, up.tmp
    target = store._target(key)
    try:
        fs.pipe_file(f"{tmp}/{MANIFEST}", manifest_of(key, kind, schema_kind, up.files, up.digest, extra))
        existing = store.get(key)
        if existing is not None:
            fs.rm(tmp, recursive=True)
            logger.info("artifact %s was published concurrently; discarded our copy", key)
            return existing
        if fs.exists(target):
            raise FileExistsError(incomplete_message(key, store._uri(target)))
        for rel in [*(f["path"] for f in up.files), MANIFEST]:
            dst = f"{target}/{rel}"
            fs.makedirs(posixpath.dirname(dst), exist_ok=True)
            fs.mv(f"{tmp}/{rel}", dst)
    except BaseException:
        discard(fs, tmp)
        raise
    try:
        if fs.exists(tmp):
            fs.rm(tmp, recursive=True)  # empty pseudo-folders some filesystems keep
    except FileNotFoundError:
        pass
    logger.info("published %s %s at %s", kind, key, store._uri(target))
    ref = store.get(key)
    if ref is None:
        raise FileNotFoundError(f"artifact {key} vanished from {store._uri(target)} right after publishing")
    return ref


def discard(fs: fsspec.AbstractFileSystem, tmp: str) -> None:
    """Remove a remote folder if it exists (a failure is logged: `sweep` removes what is left)."""
    try:
        fs.rm(tmp, recursive=True)
    except FileNotFoundError:
        pass
    except Exception:
        logger.warning("could not remove %s after a failed publish; sweep() will", tmp, exc_info=True)


def locate(store: ArtifactStore, uri: str) -> tuple[fsspec.AbstractFileSystem | None, str]:
    """(filesystem, path) of a URI; None for local paths (read with `open`); the store's own filesystem (with its
    options) for URIs under its root."""
    path = local_path_of(uri)
    if path is not None:
        return None, str(path)
    if not store.is_local and uri.startswith(store.root + "/"):
        return store.fs, store._root + uri[len(store.root) :]
    fs, path = fsspec.core.url_to_fs(uri)
    return fs, path.rstrip("/")


def download(store: ArtifactStore, ref: ArtifactRef) -> Path:
    """The local copy of a remote artifact in `{cache_root}/{key}`: reused while its manifest digest is the ref's,
    else downloaded into a temp folder, checked against the digest, and renamed into place (a kill in between leaves
    only the temp folder, which `cache.trim` removes). The cache is then trimmed to its bound (`cache`)."""
    from posttrain_core.artifacts import cache

    dest = store.cache_root / ref.key
    cached = read_manifest(None, str(dest))
    if cached is not None and cached.get("digest") == ref.digest:
        cache.touch(dest)
        return dest
    fs, folder, manifest = _remote_manifest(store, ref)
    store.cache_root.mkdir(parents=True, exist_ok=True)
    tmp = store.cache_root / f"{TMP_PREFIX}{ref.key}-{uuid.uuid4().hex}"
    try:
        _get_files(fs, folder, manifest, tmp)
        got = content_digest(tmp, like=ref.digest)
        if got != ref.digest:
            raise ValueError(
                f"artifact {ref.key}: content downloaded from {ref.uri} has digest {got}, not {ref.digest}"
            )
        fsio.write_synced(tmp / MANIFEST, json.dumps(manifest, indent=2).encode())
        if cached is not None or dest.exists():
            shutil.rmtree(dest, ignore_errors=True)  # a stale copy (another store's artifact of the same key)
        try:
            os.rename(tmp, dest)
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # a concurrent download won
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("downloaded %s from %s to %s", ref.key, ref.uri, dest)
    cache.trim(store, check_store=False)  # within its bound; this copy, just used, stays
    return dest


def _remote_manifest(store: ArtifactStore, ref: ArtifactRef) -> tuple[fsspec.AbstractFileSystem, str, dict]:
    """(filesystem, folder, manifest) of a remote artifact whose manifest holds the ref's digest.

    Raises:
        FileNotFoundError: no readable manifest at the ref's URI.
        ValueError: the manifest holds another digest.
    """
    fs, folder = locate(store, ref.uri)
    assert fs is not None  # local URIs never get here
    manifest = read_manifest(fs, folder)
    if manifest is None:
        raise FileNotFoundError(f"artifact {ref.key}: no readable {MANIFEST} at {ref.uri}")
    if manifest.get("digest") != ref.digest:
        raise ValueError(f"artifact {ref.key}: {ref.uri} holds digest {manifest.get('digest')}, the ref {ref.digest}")
    return fs, folder, manifest


def _get_files(fs: fsspec.AbstractFileSystem, folder: str, manifest: dict, dest: Path, skip: tuple[str, ...] = ()):
    """Download the files `manifest` lists into `dest` (created); those ending in `skip` become empty placeholders."""
    dest.mkdir(parents=True, exist_ok=True)
    for entry in manifest.get("files", []):
        local = dest / entry["path"]
        local.parent.mkdir(parents=True, exist_ok=True)
        if skip and entry["path"].endswith(skip):
            local.touch()
        else:
            fs.get_file(f"{folder}/{entry['path']}", str(local))


# Files a check never reads (weights, optimizer state), left out of a metadata view as empty placeholders.
HEAVY_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npy")
VIEWS_KEPT = 16


def metadata_view(store: ArtifactStore, ref: ArtifactRef) -> Path:
    """A local folder with a remote artifact's small files (configs, tokenizer, manifest) and its heavy ones
    (`HEAVY_SUFFIXES`) as empty placeholders: what the checks on the flow's machine read (a model folder's shape, its
    tokenizer, which files it has), without downloading weights and optimizer state every RL iteration. The full
    copy when this machine already has one. The newest `VIEWS_KEPT` views are kept."""
    full = store.cache_root / ref.key
    cached = read_manifest(None, str(full))
    if cached is not None and cached.get("digest") == ref.digest:
        return full
    views = store.cache_root.parent / "views"
    view = views / ref.key
    if read_manifest(None, str(view)) is None:
        fs, folder, manifest = _remote_manifest(store, ref)
        tmp = views / f"{TMP_PREFIX}{ref.key}-{uuid.uuid4().hex}"
        try:
            _get_files(fs, folder, manifest, tmp, skip=HEAVY_SUFFIXES)
            (tmp / MANIFEST).write_text(json.dumps(manifest))
            shutil.rmtree(view, ignore_errors=True)
            os.rename(tmp, view)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    os.utime(view)
    for old in sorted(views.iterdir(), key=lambda p: p.stat().st_mtime)[:-VIEWS_KEPT]:
        shutil.rmtree(old, ignore_errors=True)
    fetch_adapter_base(store, view)
    return view


def fetch_adapter_base(store: ArtifactStore, folder: Path) -> None:
    """An adapter records its base model by the path it had where it was trained. When that path is not on this
    node and names a store artifact (a key), download the base into this node's cache, beside the adapter, where
    `models.loading` finds it."""
    config = folder / "adapter_config.json"
    if not config.exists():
        return
    base = json.loads(config.read_text()).get("base_model_name_or_path") or ""
    if not base or Path(base).exists():
        return
    try:
        check_key(Path(base).name)
    except ValueError:
        return
    ref = store.get(Path(base).name)
    if ref is not None:
        download(store, ref)


def remove(fs: fsspec.AbstractFileSystem, target: str) -> None:
    """Remove an artifact folder, manifest.json first: `get()` misses it from then on, and a crash in between leaves
    a folder without a manifest (see `sweep`)."""
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(f"{target}/{MANIFEST}")
    with contextlib.suppress(FileNotFoundError):
        fs.rm(target, recursive=True)


def sweep(store: ArtifactStore, max_age_s: float) -> int:
    """Remove `.tmp-*` folders, and the folders of deleted keys that lost their manifest (a crashed delete), older
    than `max_age_s` (any age when it is <= 0); return how many."""
    now = time.time()
    removed = 0
    try:
        prefixes = store.fs.ls(f"{store._root}/artifacts", detail=False)
    except FileNotFoundError:
        return 0
    for prefix in prefixes:
        for entry in store.fs.ls(prefix, detail=False):
            name = posixpath.basename(entry.rstrip("/"))
            if not name.startswith(TMP_PREFIX):
                if not _crashed_delete(store, name, entry):
                    continue
            mtime = _mtime(store.fs, entry)
            if max_age_s <= 0 or (mtime is not None and now - mtime >= max_age_s):
                store.fs.rm(entry, recursive=True)
                removed += 1
                logger.info("swept %s", store.fs.unstrip_protocol(entry))
    return removed


def _crashed_delete(store: ArtifactStore, name: str, entry: str) -> bool:
    """A remote key folder without a manifest whose key was deleted before: what a crashed delete() leaves."""
    try:
        check_key(name)
    except ValueError:
        return False
    return store.generation(name) > 0 and not store.fs.exists(f"{entry.rstrip('/')}/{MANIFEST}")


def _mtime(fs: fsspec.AbstractFileSystem, folder: str) -> float | None:
    """Newest modification time (epoch seconds) of the files under a remote folder; None when unknown."""
    try:
        infos = fs.find(folder, detail=True).values()
    except (FileNotFoundError, NotImplementedError):
        return None
    times = []
    for info in infos:
        for name in ("mtime", "LastModified", "last_modified", "modified", "updated", "created"):
            value = info.get(name)
            if isinstance(value, str):
                try:
                    value = datetime.fromisoformat(value.replace("Z", "+00:00"))
                except ValueError:
                    continue
            if isinstance(value, datetime):
                value = value.replace(tzinfo=value.tzinfo or UTC).timestamp()
            if isinstance(value, int | float):
                times.append(float(value))
                break
    return max(times) if times else None
