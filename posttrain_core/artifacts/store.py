"""`ArtifactStore`: maps stage keys to complete, immutable artifact folders; its public API and the checks common to
local and remote roots, which then go to `local.py` (atomic rename) or `remote.py` (fsspec, manifest last).
A little over ~400 lines: it is the store's whole public API, one class, kept together.
"""

from __future__ import annotations

import hashlib
import logging
import os
import posixpath
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem
from pydantic import ValidationError

from posttrain_core.artifacts import local, remote
from posttrain_core.artifacts.digest import file_digest, fingerprint
from posttrain_core.artifacts.manifest import STORE_FIELDS, read_manifest
from posttrain_core.artifacts.ref import (
    EXTERNAL_PREFIX,
    KINDS,
    MANIFEST,
    TMP_PREFIX,
    ArtifactRef,
    Kind,
    check_key,
    external_entry,
    incomplete_message,
    local_path_of,
    ref_from_manifest,
)
from posttrain_core.env import default_store, setting

logger = logging.getLogger(__name__)

TOMBSTONES = "tombstones"
CHECKPOINTS = "checkpoints"


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
            (`{root}/staging`, `{root}/cache`), for a remote one this machine's `$POSTTRAIN_CACHE_DIR`, else
            `~/.cache/posttrain` (`staging/<sha of root>`, `cache`).
    """

    def __init__(self, root: str | os.PathLike | None = None, *, workdir: str | os.PathLike | None = None) -> None:
        if root is None:
            root = default_store()
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
            base = Path(setting("POSTTRAIN_CACHE_DIR") or Path.home() / ".cache" / "posttrain").expanduser().resolve()
            self.staging_root, self.cache_root = base / "staging" / root_sha, base / "cache"
        # Pictures a flow draws for people (reward curves; they also reach MLflow as run artifacts).
        self.reports_root = self.own_dir("reports")

    def own_dir(self, name: str) -> Path:
        """A folder `name` of this machine's own for the store (reports, a service's journal): in the store when it
        is a folder, else beside this machine's staging for it, `{cache dir}/{name}/{hash of the root}`."""
        if self.is_local:
            return Path(self._root) / name
        return self.staging_root.parent.parent / name / self.staging_root.name

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
                f"`store` (or $POSTTRAIN_STORE) to a folder or URI this process can write"
            ) from None

    # ----------------------------------------------------------------------------------------------- reading
    def get(self, key: str) -> ArtifactRef | None:
        """The ref of the complete artifact stored under `key`, or None (absent, or only partly written).

        Raises:
            ValueError: the key is malformed, or the folder's manifest names another key.
        """
        check_key(key)
        target = self._target(key)
        manifest = read_manifest(self.fs if not self.is_local else None, target)
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
            return external_entry(ref)
        check_key(key)
        target = self._target(key)
        manifest = read_manifest(self.fs if not self.is_local else None, target)
        if manifest is None and ref is not None and ref.uri != self._uri(target):
            fs, folder = remote.locate(self, ref.uri)
            manifest = read_manifest(fs, folder)
        if manifest is None:
            where = self._uri(target) if ref is None else f"{self._uri(target)} or {ref.uri}"
            raise FileNotFoundError(f"no complete artifact {key!r} (no readable {MANIFEST} at {where})")
        return manifest

    def generation(self, key: str) -> int:
        """How many times the artifact `key` was deleted from this store (0: never).

        Caches above the store (Prefect's task records, `tasks.common.stage_cache`) put it in their keys, so a record
        that holds a ref to a deleted artifact is never reused: the stage rebuilds it under the same key.
        """
        check_key(key)
        path = self._tombstone(key)
        try:
            data = Path(path).read_bytes() if self.is_local else self.fs.cat_file(path)
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
        """The local folder of an artifact; one from a remote store is downloaded once into `{cache_root}/{key}`
        (a LoRA adapter's base artifact with it, beside it: `remote.fetch_adapter_base`).

        The cached copy is reused while its manifest digest equals the ref's, and checked against the digest when
        downloaded.

        Raises:
            FileNotFoundError: the local folder (or registered external file) or the remote manifest does not exist.
            ValueError: the remote artifact's content does not match the ref's digest.
        """
        path = local_path_of(ref.uri)
        if path is not None:
            if not path.exists():
                raise FileNotFoundError(f"artifact {ref.key}: {path} does not exist")
            return path
        path = remote.download(self, ref)
        remote.fetch_adapter_base(self, path)
        return path

    def metadata_path(self, ref: ArtifactRef) -> Path:
        """A local folder to *check* an artifact by (its configs, tokenizer and file list), never to load weights
        from: `local_path` for a local store; for a remote one its small files, the weights and optimizer state
        as empty placeholders (`remote.metadata_view`), or the full copy when this machine has it."""
        if local_path_of(ref.uri) is not None:
            return self.local_path(ref)
        return remote.metadata_view(self, ref)

    # ----------------------------------------------------------------------------------------------- staging
    def staging_dir(self, key: str) -> Path:
        """A deterministic local folder for `key` that persists across attempts of a stage (created if missing).

        Stages keep their in-stage checkpoints here, so a retried stage resumes instead of restarting.
        """
        check_key(key)
        path = self.staging_root / key
        path.mkdir(parents=True, exist_ok=True)
        return path

    def clear_staging(self, key: str) -> None:
        """Delete the staging folder of `key` (checkpoints and unpublished outputs), if any, and for a remote store
        the in-stage checkpoints its Ray workers kept in it (`checkpoints/{key}/`, see `node.Outbox`)."""
        check_key(key)
        shutil.rmtree(self.staging_root / key, ignore_errors=True)
        if not self.is_local:
            remote.discard(self.fs, self.checkpoint_prefix(key))

    def checkpoint_prefix(self, key: str) -> str:
        """Where a remote store keeps the in-stage checkpoints of `key` while it is being built (a path on `fs`)."""
        check_key(key)
        return f"{self._root}/{CHECKPOINTS}/{key}"

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
        src_dir: str | os.PathLike | remote.Uploaded,
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
            src_dir: local folder with the content (no manifest.json), e.g. from `new_output_dir(key)`; or, for a
                remote store, content a Ray worker already uploaded (`node.Outbox.ship`).
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
        check_key(key)
        if kind not in KINDS:
            raise ValueError(f"publish {key}: kind must be one of {KINDS}, got {kind!r}")
        uploaded = src_dir if isinstance(src_dir, remote.Uploaded) else None
        if uploaded is not None:
            if self.is_local or uploaded.key != key:
                raise ValueError(f"publish {key}: content uploaded for {uploaded.key} to {uploaded.tmp} is not ours")
        else:
            src = Path(src_dir)
            if not src.is_dir():
                raise FileNotFoundError(f"publish {key}: source folder {src} does not exist or is not a folder")
            if (src / MANIFEST).exists():
                raise ValueError(
                    f"publish {key}: {src / MANIFEST} exists; the store writes the manifest, not the stage"
                )
        own = {"kind": kind, "key": key, "schema_kind": schema_kind}
        for name in sorted(STORE_FIELDS & manifest.keys()):
            if name not in own or manifest[name] != own[name]:
                raise ValueError(f"publish {key}: manifest field {name!r} is set by the store; do not pass it")
        target = self._target(key)
        existing = self.get(key)
        if existing is None and self._exists(target):
            existing = self.get(key)  # a concurrent publisher may have renamed it into place in between
            if existing is None:
                raise FileExistsError(incomplete_message(key, self._uri(target)))
        if existing is not None:
            logger.info("artifact %s already exists at %s; not publishing %s", key, existing.uri, src_dir)
            if uploaded is not None:
                remote.discard(self.fs, uploaded.tmp)
            return existing
        extra = {k: v for k, v in manifest.items() if k not in own}
        if uploaded is not None:
            return remote.commit(self, kind, uploaded, extra, schema_kind)
        side = local if self.is_local else remote
        return side.publish(self, key, kind, src, extra, schema_kind)

    def register_external(
        self, path: str | os.PathLike, kind: Kind = "model", schema_kind: str | None = None
    ) -> ArtifactRef:
        """A ref on a user's existing folder (e.g. a Hugging Face model folder), used as an input without copying.

        A folder's digest is a fingerprint of (relative path, size, mtime_ns) of its files, not of their bytes: cheap
        for multi-GB folders, but a content change that keeps both size and mtime goes undetected. A single file (a
        user's JSONL, a GGUF model) is digested by name and bytes: a copy elsewhere keys the same. Nothing is written
        into the folder. Its ref's URI is the folder or file.

        Raises:
            FileNotFoundError: the path does not exist (names it).
        """
        if kind not in KINDS:
            raise ValueError(f"register_external {path}: kind must be one of {KINDS}, got {kind!r}")
        folder = Path(path).expanduser()
        if not folder.exists():
            raise FileNotFoundError(f"external artifact folder {folder} does not exist")
        folder = folder.resolve()
        digest = file_digest(folder) if folder.is_file() else fingerprint(folder)
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
        check_key(key)
        target = self._target(key)
        complete = self.get(key) is not None
        if self._exists(target):
            self._write_tombstone(key, self.generation(key) + 1)
            if self.is_local:
                complete = local.remove(Path(target), key) and complete  # False: a concurrent delete won
            else:
                remote.remove(self.fs, target)
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
        return local.sweep(self, max_age_s) if self.is_local else remote.sweep(self, max_age_s)

    # ------------------------------------------------------------------ internals (also used by local, remote)
    def _target(self, key: str) -> str:
        return f"{self._root}/artifacts/{key[:2]}/{key}"

    def _tombstone(self, key: str) -> str:
        return f"{self._root}/{TOMBSTONES}/{key}"

    def _exists(self, path: str) -> bool:
        return os.path.lexists(path) if self.is_local else self.fs.exists(path)

    def _write_tombstone(self, key: str, count: int) -> None:
        path = self._tombstone(key)
        body = f"{count}\n".encode()
        if self.is_local:
            local.write_tombstone(Path(path), key, body)
        else:
            self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
            self.fs.pipe_file(path, body)

    def _uri(self, path: str) -> str:
        return path if self.is_local else self.fs.unstrip_protocol(path)
