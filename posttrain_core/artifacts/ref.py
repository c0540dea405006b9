"""What names an artifact: the `ArtifactRef` handle stages exchange, the folder names and key rules of a store.

Pure data: no I/O beyond resolving a ref's local path, so every other module of the package can import it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

Kind = Literal["dataset", "model"]
KINDS: tuple[str, ...] = ("dataset", "model")
SCHEMA_KINDS: tuple[str, ...] = ("prompts", "sft", "preferences", "rollouts", "scored_rollouts", "eval", "text")
MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"
# `.tmp-{key}-del-{uuid hex}`: an artifact moved aside by delete(); garbage by construction, swept at any age.
DELETED = re.compile(r"^\.tmp-(?P<key>.+)-del-[0-9a-f]{32}$")
EXTERNAL_PREFIX = "external-"


class ArtifactRef(BaseModel):
    """A small, frozen, picklable handle on one artifact: what Prefect tasks return and Ray workers receive."""

    model_config = ConfigDict(frozen=True)

    kind: Kind = Field(description="'dataset' (Arrow files) or 'model' (a Hugging Face checkpoint folder)")
    key: str = Field(
        description="the stage key that produced it, or 'external-<digest[:16]>' for a registered external folder"
    )
    uri: str = Field(description="where the artifact folder lives: an absolute local path or an fsspec URI")
    digest: str = Field(
        description="'blake3:<hex>' over the content files (sorted relative paths, sizes and bytes; manifest.json "
        "excluded), or a bare sha256 hex digest of the same for artifacts of older stores (still verified); "
        "for external folders a sha256 fingerprint of (path, size, mtime); for an external file 'blake3:<hex>' of its "
        "name and bytes"
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
        local = local_path_of(self.uri)
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


def external_entry(ref: ArtifactRef) -> dict[str, Any]:
    """What stands for the manifest of an external ref (it has none)."""
    return {"key": ref.key, "uri": ref.uri, "external": True, "kind": ref.kind, "digest": ref.digest}


def check_key(key: str) -> None:
    """Keys become folder names: refuse anything that could escape the store or collide with a temp folder."""
    if (
        not isinstance(key, str)
        or len(key) < 3
        or not key[0].isalnum()
        or not all(c.isalnum() or c in "-_." for c in key)
        or not key.isascii()
    ):
        raise ValueError(f"invalid artifact key {key!r}: use ASCII letters, digits, '-', '_', '.' (3+ chars)")


def incomplete_message(key: str, where: str) -> str:
    """The error of a publish whose target folder exists without a manifest."""
    return (
        f"cannot publish {key}: {where} exists but has no readable {MANIFEST}, so it is not a complete artifact "
        "(a foreign leftover?); inspect and remove it"
    )


def local_path_of(uri: str) -> Path | None:
    """The local path a URI names (a plain path or `file://`), or None for a remote URI."""
    if "://" not in uri:
        return Path(uri)
    if uri.startswith("file://"):
        return Path(uri[len("file://") :])
    return None
