"""Stage keys: the deterministic identity of a stage run (stage name, config, input digests, code version).

The same key names the artifact in the store and the Prefect cache entry, so a re-run resumes where it stopped.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel

import posttrain_core
from posttrain_core.env import setting

CODE_VERSION_ENV = "POSTTRAIN_CODE_VERSION"


@functools.lru_cache(maxsize=1)
def _package_hash() -> str:
    """First 12 hex digits of sha256 over the sorted relative paths and bytes of the package's `*.py` files."""
    package_dir = Path(posttrain_core.__file__).resolve().parent
    files = sorted((p.relative_to(package_dir).as_posix(), p) for p in package_dir.rglob("*.py") if p.is_file())
    h = hashlib.sha256()
    for rel, path in files:
        data = path.read_bytes()
        # Length-prefixed so that moving bytes between a path and its content cannot give the same hash.
        h.update(f"{rel}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()[:12]


def code_version() -> str:
    """The version of the core code that goes into every stage key: `"{__version__}+{hash of posttrain_core/*.py}"`.

    Why not the package version alone: it does not change on every edit. Why not Prefect's `TASK_SOURCE` cache
    policy: it hashes only the task function's own lines, while the maths lives in `posttrain_core`, so an edit in a
    loss function would silently reuse stale cached stages. Hashing the whole core invalidates the stage caches on
    any core edit (also one that does not matter; a re-run is the safe side).

    Set the environment variable `POSTTRAIN_CODE_VERSION` to pin the version (e.g. in a deployment whose stores
    should survive unrelated code edits); it is read on every call.

    Returns:
        e.g. `"0.1.0+3fa94c0e12ab"`.
    """
    pinned = setting(CODE_VERSION_ENV)
    if pinned:
        return pinned
    return f"{posttrain_core.__version__}+{_package_hash()}"


def _json_default(obj: Any) -> Any:
    if isinstance(obj, BaseModel):
        return obj.model_dump(mode="json")
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, set | frozenset):
        return sorted(obj)
    raise TypeError(f"canonical_json: cannot serialise a {type(obj).__name__} ({obj!r:.80})")


def canonical_json(obj: Any) -> str:
    """Canonical JSON text of a config or any JSON-like value: sorted keys, no whitespace.

    Args:
        obj: a pydantic model (dumped with `model_dump(mode="json")`), or dicts/lists/scalars, which may contain
            pydantic models and paths.

    Returns:
        The same string for equal values, whatever the dict insertion order.

    Raises:
        TypeError: for a value that has no JSON form (names its type).
    """
    if isinstance(obj, BaseModel):
        obj = obj.model_dump(mode="json")
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=_json_default)


def stage_key(stage: str, config: Any, input_digests: Sequence[str], version: str | None = None) -> str:
    """The key of one stage run: sha256 of the canonical JSON of (stage, config, input digests, code version).

    Args:
        stage: the stage name, e.g. `"sft"`.
        config: the stage's pydantic config (or a JSON-like dict).
        input_digests: the input artifacts' digests (`ref.digest`), in the stage's argument order (order matters:
            policy and reference differ).
        version: the code version; `code_version()` when None.

    Returns:
        64 hex digits. Changes when the stage, the config, any input digest or the version changes, and only then.

    Raises:
        TypeError: `input_digests` is not a sequence of strings (e.g. refs: pass `ref.digest`, not the ref).
    """
    inputs = list(input_digests)
    if isinstance(input_digests, str) or not all(isinstance(d, str) for d in inputs):
        raise TypeError(f"stage_key({stage!r}): expected a list of digests (ref.digest), got {input_digests!r:.80}")
    payload = {"stage": stage, "config": config, "inputs": inputs, "version": version or code_version()}
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()
