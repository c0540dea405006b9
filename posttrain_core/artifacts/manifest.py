"""manifest.json, the file whose presence makes an artifact folder complete: built at publish, parsed at read.

The store's own fields (`STORE_FIELDS`: kind, key, digest, files, created...) come first, the stage's after.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import fsspec
from pydantic_core import to_jsonable_python

from posttrain_core.artifacts.digest import content_digest
from posttrain_core.artifacts.fsio import content_files
from posttrain_core.artifacts.keys import code_version
from posttrain_core.artifacts.ref import MANIFEST

logger = logging.getLogger(__name__)

# Fields of manifest.json that the store itself sets; a caller may not pass other values for them.
STORE_FIELDS = frozenset({"kind", "key", "schema_kind", "digest", "files", "created", "posttrain_version"})


def describe(folder: Path) -> tuple[list[dict[str, Any]], str]:
    """The manifest's `files` (relative path and size of each content file) and `digest` of a local folder."""
    files = [{"path": rel, "size": path.stat().st_size} for rel, path in content_files(folder)]
    return files, content_digest(folder)


def content_bytes(manifest: Mapping[str, Any]) -> int:
    """An artifact's content size in bytes, as its manifest's `files` list it."""
    return sum(int(f.get("size", 0)) for f in manifest.get("files") or [])


def manifest_bytes(key: str, kind: str, schema_kind: str | None, folder: Path, extra: Mapping) -> bytes:
    """The manifest.json of the content in `folder` (digested here) with the stage's `extra` fields."""
    return manifest_of(key, kind, schema_kind, *describe(folder), extra)


def manifest_of(
    key: str, kind: str, schema_kind: str | None, files: list[dict[str, Any]], digest: str, extra: Mapping
) -> bytes:
    """The manifest.json of content described by `files` and `digest` (`describe`) with the stage's `extra` fields.

    Raises:
        ValueError: an `extra` field has no JSON form.
    """
    manifest = {
        "kind": kind,
        "key": key,
        "schema_kind": schema_kind,
        "digest": digest,
        "files": files,
        "created": datetime.now(UTC).isoformat(),
        "posttrain_version": code_version(),
        **extra,
    }
    try:
        return json.dumps(manifest, indent=2, default=to_jsonable_python).encode()
    except (TypeError, ValueError) as e:
        raise ValueError(f"publish {key}: manifest fields are not JSON-serialisable: {e}") from e


def read_manifest(fs: fsspec.AbstractFileSystem | None, folder: str) -> dict[str, Any] | None:
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
