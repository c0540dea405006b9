"""The artifact store: immutable, digested folders (Arrow datasets, Hugging Face checkpoints) published atomically.

Stages exchange small frozen `ArtifactRef`s; the store maps a stage key to a complete artifact or to nothing.

Layout under the store root (a local folder or any fsspec URI):

    artifacts/{key[:2]}/{key}/                   one complete artifact: content files + manifest.json (written last)
    artifacts/{key[:2]}/.tmp-{key}-{uuid}/       a publish in progress, or the leftover of a crashed one (`sweep()`)
    artifacts/{key[:2]}/.tmp-{key}-del-{uuid}/   local stores: an artifact being deleted (`delete()`), or the
                                                 leftover of a crashed delete (`sweep()`)
    tombstones/{key}                             how many times `key` was deleted (`generation()`); absent: never
    staging/{key}/                               local stores only: per-key working folder that survives retries
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import logging
import os
import posixpath
import re
import shutil
import sys
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import fsspec
from fsspec.implementations.local import LocalFileSystem
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import to_jsonable_python

from posttrain_core.keys import code_version

logger = logging.getLogger(__name__)

Kind = Literal["dataset", "model"]
KINDS: tuple[str, ...] = ("dataset", "model")
SCHEMA_KINDS: tuple[str, ...] = ("prompts", "sft", "preferences", "rollouts", "scored_rollouts", "eval", "text")
MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"
TOMBSTONES = "tombstones"
# `.tmp-{key}-del-{uuid hex}`: an artifact moved aside by delete(); garbage by construction, swept at any age.
_DELETED = re.compile(r"^\.tmp-(?P<key>.+)-del-[0-9a-f]{32}$")
EXTERNAL_PREFIX = "external-"
STORE_ENV = "POSTTRAIN_STORE"
DEFAULT_ROOT = "./.posttrain"
# Fields of manifest.json that the store itself sets; a caller may not pass other values for them.
STORE_FIELDS = frozenset({"kind", "key", "schema_kind", "digest", "files", "created", "posttrain_version"})


class ArtifactRef(BaseModel):
    """A small, frozen, picklable handle on one artifact: what Prefect tasks return and Ray workers receive."""

    model_config = ConfigDict(frozen=True)

    kind: Kind = Field(description="'dataset' (Arrow files) or 'model' (a Hugging Face checkpoint folder)")
    key: str = Field(
        description="the stage key that produced it, or 'external-<digest[:16]>' for a registered external folder"
    )
    uri: str = Field(description="where the artifact folder lives: an absolute local path or an fsspec URI")
    digest: str = Field(
        description="sha256 over the content files (sorted relative paths + bytes, manifest.json excluded); "
        "for external folders a fingerprint of (path, size, mtime)"
    )
    schema_kind: str | None = Field(
        None, description="datasets: prompts | sft | preferences | rollouts | scored_rollouts | eval | text"
    )

    @property
    def external(self) -> bool:
        """True for a user's folder registered with `ArtifactStore.register_external` (no manifest, not in a store)."""
        return self.key.startswith(EXTERNAL_PREFIX)

    @property
    def path(self) -> Path:
        """The artifact's local folder.

        Raises:
            ValueError: the artifact lives in a remote store; use `ArtifactStore.local_path(ref)`, which downloads it.
        """
        local = _local_path_of(self.uri)
        if local is None:
            raise ValueError(
                f"artifact {self.key} lives at {self.uri}, not on the local disk; use ArtifactStore.local_path(ref)"
            )
        return local


def ref_from_manifest(manifest: Mapping[str, Any], uri: str) -> ArtifactRef:
    """The ref of the artifact described by `manifest` that lives at `uri`.

    Raises:
        ValueError: the manifest lacks kind/key/digest or holds invalid values (names the URI).
    """
    try:
        return ArtifactRef(
            kind=manifest["kind"],
            key=manifest["key"],
            uri=uri,
            digest=manifest["digest"],
            schema_kind=manifest.get("schema_kind"),
        )
    except (KeyError, ValidationError) as e:
        raise ValueError(f"{uri}/{MANIFEST}: not a valid artifact manifest ({e})") from e


DIGEST_PREFIX = "blake3:"


def content_digest(folder: str | os.PathLike, like: str | None = None) -> str:
    """The digest of a local folder's content: its files' sorted relative paths, sizes and bytes; a top-level
    manifest.json is excluded (it holds the digest itself).

    BLAKE3, written `blake3:<64 hex>`: a cryptographic hash ~3x faster than sha256 on one core (a 123 MB checkpoint
    in 27 ms, not 79; bench/NOTES.md, change 24), so publishing an RL update's checkpoint costs less of each
    iteration. Artifacts of stores written before hold a bare sha256 hex digest: `like` = such a digest recomputes
    the content the same way (verifying a download of an old artifact).
    """
    if like is not None and not like.startswith(DIGEST_PREFIX):
        h, prefix = hashlib.sha256(), ""
    else:
        import blake3

        h, prefix = blake3.blake3(), DIGEST_PREFIX
    buf = bytearray(1 << 22)
    view = memoryview(buf)
    for rel, path in _content_files(Path(folder)):
        h.update(f"{rel}\0{path.stat().st_size}\0".encode())
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                h.update(view[:n])
    return prefix + h.hexdigest()


class ArtifactStore:
    """Maps stage keys to complete, immutable artifact folders, on a local disk or any fsspec filesystem.

    Guarantees: `get()` returns only complete artifacts (manifest.json present); a crash during `publish()` leaves at
    most a `.tmp-*` folder (removed by `sweep()`); concurrent publishers of one key end with exactly one artifact and
    all get its ref; `delete()` makes an artifact invisible at once (never partly visible) and counts the deletion
    in `generation(key)`.

    Args:
        root: local folder or fsspec URI (`file://`, `memory://`, `s3://`...). Default: the environment variable
            `POSTTRAIN_STORE`, else `./.posttrain` (made absolute).
        workdir: local folder for staging and downloads. Default: the root itself for a local store
            (`{root}/staging`, `{root}/cache`), `~/.cache/posttrain` for a remote one
            (`staging/<sha of root>`, `cache`).
    """

    def __init__(self, root: str | os.PathLike | None = None, *, workdir: str | os.PathLike | None = None) -> None:
        if root is None:
            root = os.environ.get(STORE_ENV) or DEFAULT_ROOT
        fs, path = fsspec.core.url_to_fs(os.fspath(root))
        self.fs: fsspec.AbstractFileSystem = fs
        self.is_local = isinstance(fs, LocalFileSystem)
        if self.is_local:
            self._root = str(Path(path).resolve())
            self.root = self._root
        else:
            self._root = path.rstrip("/")
            self.root = fs.unstrip_protocol(self._root)
        root_sha = hashlib.sha256(self.root.encode()).hexdigest()[:16]
        if workdir is not None:
            base = Path(workdir).expanduser().resolve()
            self.staging_root, self.cache_root = base / "staging" / root_sha, base / "cache"
        elif self.is_local:
            self.staging_root, self.cache_root = Path(self._root) / "staging", Path(self._root) / "cache"
        else:
            base = Path.home() / ".cache" / "posttrain"
            self.staging_root, self.cache_root = base / "staging" / root_sha, base / "cache"

    def __repr__(self) -> str:
        return f"ArtifactStore({self.root!r})"

    def check_writable(self) -> None:
        """Fail now, before any work, when artifacts could not be published here (a flow calls this first).

        Creates the store's folders if needed and writes then removes a probe file under `artifacts/` (and the
        local staging folder).

        Raises:
            PermissionError: the store root (or its staging folder) cannot be created or written; names the path
                and the `store` setting / $POSTTRAIN_STORE to change.
        """
        probe = f".write-probe-{uuid.uuid4().hex}"
        where = self.root
        try:
            if self.is_local:
                for folder in (Path(self._root) / "artifacts", self.staging_root):
                    where = str(folder)
                    folder.mkdir(parents=True, exist_ok=True)
                    (folder / probe).write_bytes(b"")
                    (folder / probe).unlink()
            else:
                path = f"{self._root}/artifacts/{probe}"
                self.fs.pipe_file(path, b"")
                self.fs.rm_file(path)
                where = str(self.staging_root)
                self.staging_root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise PermissionError(
                f"artifact store {self.root} is not writable ({where}: {err.strerror or err}); set the flow's "
                f"`store` (or ${STORE_ENV}) to a folder or URI this process can write"
            ) from None

    # ----------------------------------------------------------------------------------------------- reading
    def get(self, key: str) -> ArtifactRef | None:
        """The ref of the complete artifact stored under `key`, or None (absent, or only partly written).

        Raises:
            ValueError: the key is malformed, or the folder's manifest names another key.
        """
        _check_key(key)
        target = self._target(key)
        manifest = self._read_manifest(self.fs if not self.is_local else None, target)
        if manifest is None:
            return None
        if manifest.get("key") != key:
            raise ValueError(
                f"{self._uri(target)}/{MANIFEST} names key {manifest.get('key')!r}, not its folder's key {key!r}"
            )
        return ref_from_manifest(manifest, self._uri(target))

    def manifest(self, ref_or_key: ArtifactRef | str) -> dict[str, Any]:
        """The manifest of an artifact: looked up in this store by key, else read at the ref's URI.

        External refs have no manifest file; they get `{"key", "uri", "external": True, "kind", "digest"}`.

        Raises:
            FileNotFoundError: no complete artifact under that key here nor at the ref's URI.
        """
        ref = ref_or_key if isinstance(ref_or_key, ArtifactRef) else None
        key = ref.key if ref is not None else ref_or_key
        if ref is not None and ref.external:
            return _external_entry(ref)
        _check_key(key)
        target = self._target(key)
        manifest = self._read_manifest(self.fs if not self.is_local else None, target)
        if manifest is None and ref is not None and ref.uri != self._uri(target):
            fs, folder = self._locate(ref.uri)
            manifest = self._read_manifest(fs, folder)
        if manifest is None:
            where = self._uri(target) if ref is None else f"{self._uri(target)} or {ref.uri}"
            raise FileNotFoundError(f"no complete artifact {key!r} (no readable {MANIFEST} at {where})")
        return manifest

    def generation(self, key: str) -> int:
        """How many times the artifact `key` was deleted from this store (0: never).

        Caches above the store (Prefect's task records, `tasks.common.stage_cache`) put it in their keys, so a record
        that holds a ref to a deleted artifact is never reused: the stage rebuilds it under the same key.
        """
        _check_key(key)
        path = self._tombstone(key)
        try:
            if self.is_local:
                data = Path(path).read_bytes()
            else:
                data = self.fs.cat_file(path)
        except (FileNotFoundError, NotADirectoryError):
            return 0
        try:
            return int(data.decode().strip() or 0)
        except ValueError as e:
            raise ValueError(f"{self._uri(path)}: not a deletion count ({data[:40]!r}); remove the file") from e

    def list(self, kind: Kind | None = None) -> list[ArtifactRef]:
        """The complete artifacts in the store (optionally of one kind), sorted by key."""
        if self.is_local:
            base = Path(self._root) / "artifacts"
            keys = [p.name for p in base.glob("*/*") if p.is_dir()] if base.is_dir() else []
        else:
            found = self.fs.glob(f"{self._root}/artifacts/*/*/{MANIFEST}")
            keys = [posixpath.basename(posixpath.dirname(p)) for p in found]
        refs = []
        for key in sorted(set(keys)):
            if key.startswith(TMP_PREFIX):
                continue
            try:
                ref = self.get(key)
            except ValueError as e:
                logger.warning("skipping artifact folder %s: %s", key, e)
                continue
            if ref is not None and (kind is None or ref.kind == kind):
                refs.append(ref)
        return refs

    def lineage(self, ref: ArtifactRef) -> list[dict[str, Any]]:
        """The manifest of `ref`, then its inputs' manifests, recursively: depth first, each artifact once.

        Inputs are the `inputs` field of each manifest (a list of ArtifactRef dicts). External inputs appear as
        `{"key", "uri", "external": True, "kind", "digest"}`.

        Raises:
            FileNotFoundError: an artifact in the chain is missing (names it).
            ValueError: a manifest's `inputs` entry is not an ArtifactRef (names the artifact and the index).
        """
        out: list[dict[str, Any]] = []
        seen: set[str] = set()
        stack = [ref]  # explicit stack: RL chains can be deeper than Python's recursion limit
        while stack:
            current = stack.pop()
            if current.key in seen:
                continue
            seen.add(current.key)
            manifest = self.manifest(current)
            out.append(manifest)
            if current.external:
                continue
            children = []
            for i, item in enumerate(manifest.get("inputs") or []):
                try:
                    children.append(ArtifactRef.model_validate(item))
                except ValidationError as e:
                    raise ValueError(
                        f"artifact {current.key}: {MANIFEST} inputs[{i}] is not an ArtifactRef: {e}"
                    ) from e
            stack.extend(reversed(children))
        return out

    def local_path(self, ref: ArtifactRef) -> Path:
        """The local folder of an artifact; one from a remote store is downloaded once into `{cache_root}/{key}`.

        The cached copy is reused while its manifest digest equals the ref's, and checked against the digest when
        downloaded.

        Raises:
            FileNotFoundError: the local folder (or registered external file) or the remote manifest does not exist.
            ValueError: the remote artifact's content does not match the ref's digest.
        """
        local = _local_path_of(ref.uri)
        if local is not None:
            if not local.exists():
                raise FileNotFoundError(f"artifact {ref.key}: {local} does not exist")
            return local
        return self._download(ref)

    # ----------------------------------------------------------------------------------------------- staging
    def staging_dir(self, key: str) -> Path:
        """A deterministic local folder for `key` that persists across attempts of a stage (created if missing).

        Stages keep their in-stage checkpoints here, so a retried stage resumes instead of restarting.
        """
        _check_key(key)
        path = self.staging_root / key
        path.mkdir(parents=True, exist_ok=True)
        return path

    def clear_staging(self, key: str) -> None:
        """Delete the staging folder of `key` (checkpoints and unpublished outputs), if any."""
        _check_key(key)
        shutil.rmtree(self.staging_root / key, ignore_errors=True)

    def new_output_dir(self, key: str) -> Path:
        """A fresh, unique local folder (`{staging}/{key}/out-<uuid>`) for a stage to write its artifact content."""
        path = self.staging_dir(key) / f"out-{uuid.uuid4().hex}"
        path.mkdir()
        return path

    # ----------------------------------------------------------------------------------------------- writing
    def publish(
        self,
        key: str,
        kind: Kind,
        src_dir: str | os.PathLike,
        manifest: Mapping[str, Any],
        schema_kind: str | None = None,
    ) -> ArtifactRef:
        """Publish the content of `src_dir` atomically as the artifact `key`.

        The content is moved into a temporary folder beside the target, digested and fsynced; manifest.json is
        written last; then the folder is renamed onto the target. An artifact is never overwritten or merged: if a
        complete one exists under `key`, its ref is returned (and `src_dir` left as is); if a concurrent publisher
        wins the rename, our copy is deleted and the winner's ref returned. On success `src_dir` is consumed (moved
        or uploaded, then removed); on a failure its content is put back.

        Remote (fsspec) stores have no atomic folder rename: the content is uploaded into the temporary folder,
        the manifest last, then moved file by file, manifest last. Readers stay safe because `get()` requires the
        manifest; two concurrent publishers of one key on an object store are not fully serialised (the Prefect
        cache key normally ensures a single writer).

        Args:
            key: the stage key.
            kind: "dataset" or "model".
            src_dir: local folder with the content (no manifest.json), e.g. from `new_output_dir(key)`.
            manifest: caller fields stored in manifest.json besides the store's own (stage, config, inputs,
                mlflow_run_id, metrics...); pydantic models and ArtifactRefs are stored as JSON.
            schema_kind: for datasets, the Arrow schema kind (see `SCHEMA_KINDS`).

        Returns:
            The ref of the published (or already existing) artifact.

        Raises:
            FileNotFoundError: `src_dir` is not a folder.
            ValueError: bad key/kind, `src_dir` holds a manifest.json, or `manifest` overrides a store field.
            FileExistsError: the target folder exists without a manifest (a foreign leftover; names it).
        """
        _check_key(key)
        if kind not in KINDS:
            raise ValueError(f"publish {key}: kind must be one of {KINDS}, got {kind!r}")
        src = Path(src_dir)
        if not src.is_dir():
            raise FileNotFoundError(f"publish {key}: source folder {src} does not exist or is not a folder")
        if (src / MANIFEST).exists():
            raise ValueError(f"publish {key}: {src / MANIFEST} exists; the store writes the manifest, not the stage")
        own = {"kind": kind, "key": key, "schema_kind": schema_kind}
        for name in sorted(STORE_FIELDS & manifest.keys()):
            if name not in own or manifest[name] != own[name]:
                raise ValueError(f"publish {key}: manifest field {name!r} is set by the store; do not pass it")
        target = self._target(key)
        existing = self.get(key)
        if existing is None and (os.path.lexists(target) if self.is_local else self.fs.exists(target)):
            existing = self.get(key)  # a concurrent publisher may have renamed it into place in between
            if existing is None:
                raise FileExistsError(_incomplete_message(key, self._uri(target)))
        if existing is not None:
            logger.info("artifact %s already exists at %s; not publishing %s", key, existing.uri, src)
            return existing
        extra = {k: v for k, v in manifest.items() if k not in own}
        if self.is_local:
            return self._publish_local(key, kind, src, extra, schema_kind)
        return self._publish_remote(key, kind, src, extra, schema_kind)

    def register_external(
        self, path: str | os.PathLike, kind: Kind = "model", schema_kind: str | None = None
    ) -> ArtifactRef:
        """A ref on a user's existing folder (e.g. a Hugging Face model folder), used as an input without copying.

        The digest is a fingerprint of (relative path, size, mtime_ns) of its files, not of their bytes: cheap for
        multi-GB folders, but a content change that keeps both size and mtime goes undetected. Nothing is written
        into the folder. A single file (e.g. a user's JSONL) is accepted too: its ref's URI is the file.

        Raises:
            FileNotFoundError: the path does not exist (names it).
        """
        if kind not in KINDS:
            raise ValueError(f"register_external {path}: kind must be one of {KINDS}, got {kind!r}")
        folder = Path(path).expanduser()
        if not folder.exists():
            raise FileNotFoundError(f"external artifact folder {folder} does not exist")
        folder = folder.resolve()
        files = _walk_files(folder) if folder.is_dir() else [(folder.name, folder)]
        h = hashlib.sha256()
        for rel, file in files:
            st = file.stat()
            h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        digest = h.hexdigest()
        return ArtifactRef(
            kind=kind, key=EXTERNAL_PREFIX + digest[:16], uri=str(folder), digest=digest, schema_kind=schema_kind
        )

    def delete(self, key: str) -> bool:
        """Delete the artifact `key` (and its staging folder and downloaded copy); return whether there was one.

        Crash-safe: a reader never sees a partial artifact. The deletion is first counted in `tombstones/{key}` (see
        `generation`); then a local store renames the folder to `.tmp-{key}-del-{uuid}` beside it (atomic: `get()`
        returns None from then on) and removes that; a remote store removes manifest.json first, then the content.
        A crash in between leaves a folder that `sweep()` removes (a remote one without its manifest: rerun
        `delete(key)` or `sweep()`). A folder without a manifest under `key` (a foreign leftover) is removed too.

        The store takes no lock: callers that may race a build of the same key hold its build lock
        (`posttrain_core.stage.try_build_lock`), as `posttrain artifacts gc` does.

        Raises:
            ValueError: the key is malformed.
        """
        _check_key(key)
        target = self._target(key)
        complete = self.get(key) is not None
        present = os.path.lexists(target) if self.is_local else self.fs.exists(target)
        if present:
            self._write_tombstone(key, self.generation(key) + 1)
            if self.is_local:
                doomed = Path(target).parent / f"{TMP_PREFIX}{key}-del-{uuid.uuid4().hex}"
                try:
                    os.rename(target, doomed)
                except FileNotFoundError:  # a concurrent delete won
                    present = complete = False
                else:
                    _fsync(doomed.parent)
                    shutil.rmtree(doomed, ignore_errors=True)
            else:
                try:
                    self.fs.rm_file(f"{target}/{MANIFEST}")
                except FileNotFoundError:
                    pass
                try:
                    self.fs.rm(target, recursive=True)
                except FileNotFoundError:
                    pass
        self.clear_staging(key)
        shutil.rmtree(self.cache_root / key, ignore_errors=True)
        if complete:
            logger.info("deleted artifact %s (generation %d)", key, self.generation(key))
        return complete

    def sweep(self, max_age_s: float = 3600) -> int:
        """Delete `.tmp-*` folders (crashed publishes and downloads) older than `max_age_s`; return how many.

        A publish in progress also owns a `.tmp-*` folder, so keep `max_age_s` above the longest publish. Leftovers
        of a crashed `delete()` go too: locally the `.tmp-{key}-del-*` folders, at any age; remotely a deleted key's
        folder that lost its manifest, once older than `max_age_s` (a remote re-publish also moves its manifest last).
        """
        now = time.time()
        removed = 0
        if self.is_local:
            in_store = list((Path(self._root) / "artifacts").glob(f"*/{TMP_PREFIX}*"))
            deleted = {tmp for tmp in in_store if _DELETED.match(tmp.name)}
            for tmp in in_store + list(self.cache_root.glob(f"{TMP_PREFIX}*")):
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
        try:
            prefixes = self.fs.ls(f"{self._root}/artifacts", detail=False)
        except FileNotFoundError:
            return 0
        for prefix in prefixes:
            for entry in self.fs.ls(prefix, detail=False):
                name = posixpath.basename(entry.rstrip("/"))
                if not name.startswith(TMP_PREFIX):
                    if not self._crashed_delete(name, entry):
                        continue
                mtime = _remote_mtime(self.fs, entry)
                if max_age_s <= 0 or (mtime is not None and now - mtime >= max_age_s):
                    self.fs.rm(entry, recursive=True)
                    removed += 1
                    logger.info("swept %s", self.fs.unstrip_protocol(entry))
        return removed

    # ----------------------------------------------------------------------------------------------- internals
    def _target(self, key: str) -> str:
        return f"{self._root}/artifacts/{key[:2]}/{key}"

    def _tombstone(self, key: str) -> str:
        return f"{self._root}/{TOMBSTONES}/{key}"

    def _write_tombstone(self, key: str, count: int) -> None:
        path = self._tombstone(key)
        body = f"{count}\n".encode()
        if not self.is_local:
            self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
            self.fs.pipe_file(path, body)
            return
        folder = Path(path).parent
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"{TMP_PREFIX}{key}-{uuid.uuid4().hex}"
        _write_manifest(tmp, body)  # write + fsync
        os.replace(tmp, path)
        _fsync(folder)

    def _crashed_delete(self, name: str, entry: str) -> bool:
        """A remote key folder without a manifest whose key was deleted before: what a crashed delete() leaves."""
        try:
            _check_key(name)
        except ValueError:
            return False
        return self.generation(name) > 0 and not self.fs.exists(f"{entry.rstrip('/')}/{MANIFEST}")

    def _uri(self, path: str) -> str:
        return path if self.is_local else self.fs.unstrip_protocol(path)

    def _manifest_bytes(self, key: str, kind: str, schema_kind: str | None, folder: Path, extra: Mapping) -> bytes:
        files = [{"path": rel, "size": path.stat().st_size} for rel, path in _content_files(folder)]
        manifest = {
            "kind": kind,
            "key": key,
            "schema_kind": schema_kind,
            "digest": content_digest(folder),
            "files": files,
            "created": datetime.now(UTC).isoformat(),
            "posttrain_version": code_version(),
            **extra,
        }
        try:
            return json.dumps(manifest, indent=2, default=to_jsonable_python).encode()
        except (TypeError, ValueError) as e:
            raise ValueError(f"publish {key}: manifest fields are not JSON-serialisable: {e}") from e

    def _publish_local(self, key: str, kind: str, src: Path, extra: Mapping, schema_kind: str | None) -> ArtifactRef:
        target = Path(self._target(key))
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.parent / f"{TMP_PREFIX}{key}-{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            _move_contents(src, tmp)  # a rename when staging and store share a disk (the default)
            # The content files are flushed to disk while the digest reads them: both wait on I/O, and a checkpoint's
            # publish takes about half the time of doing one after the other (bench/NOTES.md, change 9).
            with ThreadPoolExecutor(1, thread_name_prefix="fsync") as pool:
                flushed = pool.submit(lambda: [_fsync(path) for _, path in _content_files(tmp)])
                manifest = self._manifest_bytes(key, kind, schema_kind, tmp, extra)
                flushed.result()
            _write_manifest(tmp / MANIFEST, manifest)
            for dirpath, _, _ in os.walk(tmp, topdown=False):
                _fsync(Path(dirpath))
            try:
                os.rename(tmp, target)  # atomic; fails on a non-empty target, so a winner is never replaced
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                existing = self.get(key)
                if existing is None:
                    raise FileExistsError(_incomplete_message(key, str(target))) from e
                shutil.rmtree(tmp, ignore_errors=True)
                logger.info("artifact %s was published concurrently; discarded our copy", key)
                _remove_empty(src)
                return existing
        except BaseException:
            _restore(tmp, src)
            raise
        _fsync(target.parent)
        _remove_empty(src)
        logger.info("published %s %s at %s", kind, key, target)
        ref = self.get(key)
        if ref is None:  # cannot happen after a successful rename; guard against a foreign delete
            raise FileNotFoundError(f"artifact {key} vanished from {target} right after publishing")
        return ref

    def _publish_remote(self, key: str, kind: str, src: Path, extra: Mapping, schema_kind: str | None) -> ArtifactRef:
        fs = self.fs
        target = self._target(key)
        tmp = f"{posixpath.dirname(target)}/{TMP_PREFIX}{key}-{uuid.uuid4().hex}"
        files = [rel for rel, _ in _content_files(src)]
        try:
            for folder in sorted({posixpath.dirname(f"{tmp}/{rel}") for rel in files} | {tmp}):
                fs.makedirs(folder, exist_ok=True)
            for rel in files:
                fs.put_file(str(src / rel), f"{tmp}/{rel}")
            fs.pipe_file(f"{tmp}/{MANIFEST}", self._manifest_bytes(key, kind, schema_kind, src, extra))
            existing = self.get(key)
            if existing is not None:
                fs.rm(tmp, recursive=True)
                logger.info("artifact %s was published concurrently; discarded our copy", key)
                shutil.rmtree(src, ignore_errors=True)
                return existing
            if fs.exists(target):
                raise FileExistsError(_incomplete_message(key, self._uri(target)))
            # Object stores have no atomic rename: move the content first and the manifest last, so that get()
            # (which requires the manifest) never sees a partial artifact.
            for rel in [*files, MANIFEST]:
                dst = f"{target}/{rel}"
                fs.makedirs(posixpath.dirname(dst), exist_ok=True)
                fs.mv(f"{tmp}/{rel}", dst)
        except BaseException:
            try:
                fs.rm(tmp, recursive=True)
            except Exception:
                logger.warning("could not remove %s after a failed publish; sweep() will", tmp, exc_info=True)
            raise
        try:
            if fs.exists(tmp):
                fs.rm(tmp, recursive=True)  # empty pseudo-folders some filesystems keep
        except FileNotFoundError:
            pass
        shutil.rmtree(src, ignore_errors=True)
        logger.info("published %s %s at %s", kind, key, self._uri(target))
        ref = self.get(key)
        if ref is None:
            raise FileNotFoundError(f"artifact {key} vanished from {self._uri(target)} right after publishing")
        return ref

    def _locate(self, uri: str) -> tuple[fsspec.AbstractFileSystem | None, str]:
        """(filesystem, path) of a URI; None for local paths (read with `open`); this store's own filesystem
        (with its options) for URIs under its root."""
        local = _local_path_of(uri)
        if local is not None:
            return None, str(local)
        if not self.is_local and uri.startswith(self.root + "/"):
            return self.fs, self._root + uri[len(self.root) :]
        fs, path = fsspec.core.url_to_fs(uri)
        return fs, path.rstrip("/")

    def _read_manifest(self, fs: fsspec.AbstractFileSystem | None, folder: str) -> dict[str, Any] | None:
        """The parsed manifest.json in `folder` (local when `fs` is None), or None if absent or unparseable."""
        path = f"{folder}/{MANIFEST}"
        try:
            if fs is None:
                with open(path, "rb") as f:
                    data = f.read()
            else:
                data = fs.cat_file(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            manifest = json.loads(data)
        except ValueError:
            logger.warning("ignoring %s: not valid JSON (a foreign or damaged artifact)", path)
            return None
        if not isinstance(manifest, dict):
            logger.warning("ignoring %s: not a JSON object", path)
            return None
        return manifest

    def _download(self, ref: ArtifactRef) -> Path:
        dest = self.cache_root / ref.key
        cached = self._read_manifest(None, str(dest))
        if cached is not None and cached.get("digest") == ref.digest:
            return dest
        fs, folder = self._locate(ref.uri)
        assert fs is not None  # local URIs never reach _download
        manifest = self._read_manifest(fs, folder)
        if manifest is None:
            raise FileNotFoundError(f"artifact {ref.key}: no readable {MANIFEST} at {ref.uri}")
        if manifest.get("digest") != ref.digest:
            raise ValueError(
                f"artifact {ref.key}: {ref.uri} holds digest {manifest.get('digest')}, the ref {ref.digest}"
            )
        self.cache_root.mkdir(parents=True, exist_ok=True)
        tmp = self.cache_root / f"{TMP_PREFIX}{ref.key}-{uuid.uuid4().hex}"
        try:
            for entry in manifest.get("files", []):
                local = tmp / entry["path"]
                local.parent.mkdir(parents=True, exist_ok=True)
                fs.get_file(f"{folder}/{entry['path']}", str(local))
            if not tmp.is_dir():
                tmp.mkdir()
            got = content_digest(tmp, like=ref.digest)
            if got != ref.digest:
                raise ValueError(
                    f"artifact {ref.key}: content downloaded from {ref.uri} has digest {got}, not {ref.digest}"
                )
            _write_manifest(tmp / MANIFEST, json.dumps(manifest, indent=2).encode())
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
        return dest


# --------------------------------------------------------------------------------------------------- helpers
def _check_key(key: str) -> None:
    """Keys become folder names: refuse anything that could escape the store or collide with a temp folder."""
    if (
        not isinstance(key, str)
        or len(key) < 3
        or not key[0].isalnum()
        or not all(c.isalnum() or c in "-_." for c in key)
        or not key.isascii()
    ):
        raise ValueError(f"invalid artifact key {key!r}: use ASCII letters, digits, '-', '_', '.' (3+ chars)")


def _incomplete_message(key: str, where: str) -> str:
    return (
        f"cannot publish {key}: {where} exists but has no readable {MANIFEST}, so it is not a complete artifact "
        "(a foreign leftover?); inspect and remove it"
    )


def _external_entry(ref: ArtifactRef) -> dict[str, Any]:
    return {"key": ref.key, "uri": ref.uri, "external": True, "kind": ref.kind, "digest": ref.digest}


def _local_path_of(uri: str) -> Path | None:
    if "://" not in uri:
        return Path(uri)
    if uri.startswith("file://"):
        return Path(uri[len("file://") :])
    return None


def _walk_files(folder: Path) -> list[tuple[str, Path]]:
    """Sorted (relative POSIX path, path) of every file under `folder` (symlinked files followed)."""
    out = []
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            path = Path(dirpath, name)
            out.append((path.relative_to(folder).as_posix(), path))
    return sorted(out)


def _content_files(folder: Path) -> list[tuple[str, Path]]:
    return [(rel, path) for rel, path in _walk_files(folder) if rel != MANIFEST]


def _move_contents(src: Path, dst: Path) -> None:
    for child in sorted(src.iterdir()):
        shutil.move(str(child), str(dst / child.name))


def _restore(tmp: Path, src: Path) -> None:
    """After a failed publish, move the content back to `src`, so that a retry can publish it."""
    try:
        if not tmp.exists():
            return
        (tmp / MANIFEST).unlink(missing_ok=True)
        src.mkdir(parents=True, exist_ok=True)
        _move_contents(tmp, src)
        tmp.rmdir()
    except OSError:
        logger.warning("publish failed; could not move %s back to %s (sweep() removes it)", tmp, src, exc_info=True)


def _remove_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:
        pass


def start_writeback(folder: str | os.PathLike) -> None:
    """Ask the kernel to start writing the dirty pages of a folder's files (or of one file) to disk now, without
    waiting: Linux `sync_file_range(SYNC_FILE_RANGE_WRITE)`, nothing elsewhere. A stage that writes a large file
    some time before it publishes calls it, so that the publish's fsync finds most of the bytes on disk already
    (an RL update's 123 MB checkpoint: publish ~50 -> ~30 ms; bench/NOTES.md, change 24). Never raises: it only
    changes when the bytes reach the disk, not whether (the publish fsyncs them all the same)."""
    sync_file_range = _sync_file_range()
    if sync_file_range is None:
        return
    root = Path(folder)
    for path in [root] if root.is_file() else [p for _, p in _walk_files(root)]:
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


def _fsync(path: Path) -> None:
    """fsync a file or a folder (a folder's entry list must be durable too before the rename)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_manifest(path: Path, body: bytes) -> None:
    with open(path, "wb") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())


def _remote_mtime(fs: fsspec.AbstractFileSystem, folder: str) -> float | None:
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
