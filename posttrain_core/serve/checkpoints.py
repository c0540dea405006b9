"""Saved adapters are store artifacts: a `tinker://` path names one, and the pipeline's flows load it by that path.

`tinker://<model_id>/weights/<name>` (save_state: weights + optimizer state) and
`tinker://<model_id>/sampler_weights/<name>` (save_weights_for_sampler: weights only) map to the artifact key
`taas-<sha256 of the path>`, so any process with the store finds a path's artifact without the service. The
artifact is a peft adapter folder whose `adapter_config.json` names the base model's folder, with the base model as
its lineage input and tenant, session, model id and optimizer step in its manifest.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from posttrain_core.artifacts import ArtifactRef, ArtifactStore
from posttrain_core.artifacts.remote import Uploaded
from posttrain_core.serve.wire import UserError

PREFIX = "tinker://"
KINDS = {"weights": "state", "sampler_weights": "sampler"}
STAGE = "serve"


def tinker_path(model_id: str, kind: str, name: str) -> str:
    """The path of a checkpoint; `name` is the client's, checked here (it becomes one path segment).

    Raises:
        UserError: the name is empty or holds '/' or whitespace.
    """
    if not isinstance(name, str) or not name or "/" in name or any(c.isspace() for c in name):
        raise UserError(f"path: checkpoint name {name!r} must be non-empty, without '/' or spaces")
    return f"{PREFIX}{model_id}/{kind}/{name}"


def parse(path: str) -> tuple[str, str, str]:
    """(model_id, kind segment, name) of a tinker path.

    Raises:
        UserError: not `tinker://<model_id>/{weights|sampler_weights}/<name>`.
    """
    parts = path[len(PREFIX) :].split("/") if isinstance(path, str) and path.startswith(PREFIX) else []
    if len(parts) != 3 or parts[1] not in KINDS or not all(parts):
        raise UserError(f"path: {path!r} is not tinker://<model_id>/weights/<name> or .../sampler_weights/<name>")
    return parts[0], parts[1], parts[2]


def artifact_key(path: str) -> str:
    return "taas-" + hashlib.sha256(path.encode()).hexdigest()[:24]


def resolve(store: ArtifactStore, path: str) -> ArtifactRef:
    """The artifact a tinker path names.

    Raises:
        FileNotFoundError: no such checkpoint in this store (names the path and the store).
    """
    parse(path)
    ref = store.get(artifact_key(path))
    if ref is None:
        raise FileNotFoundError(f"no checkpoint {path} in the artifact store {store.root}")
    return ref


def base_ref(store: ArtifactStore, folder: str) -> ArtifactRef:
    """A base model folder as an artifact: the store's when the folder is one of its artifacts, else an external
    ref on the folder."""
    from posttrain_core.artifacts.manifest import read_manifest

    manifest = read_manifest(None, folder) or {}
    ref = store.get(manifest["key"]) if manifest.get("key") else None
    if ref is not None and Path(ref.uri).resolve() == Path(folder).resolve():
        return ref
    return store.register_external(folder, "model")


def publish(
    store: ArtifactStore, path: str, src: str | Uploaded, base: ArtifactRef, fields: dict[str, Any], overwrite: bool
) -> ArtifactRef:
    """Publish a saved adapter (its folder, or what a worker on another node uploaded) under its path's key.

    Raises:
        UserError: the checkpoint exists and `overwrite` is false.
    """
    key = artifact_key(path)
    if store.get(key) is not None:
        if not overwrite:
            raise UserError(f"path: checkpoint {path} exists; save under another name or pass overwrite=True")
        store.delete(key)
    _, kind, _ = parse(path)
    manifest = {
        "stage": STAGE,
        "tinker_path": path,
        "checkpoint": KINDS[kind],
        "adapter": True,
        "inputs": [base],
        **fields,
    }
    return store.publish(key, "model", src, manifest)
