"""The artifact store: immutable, digested folders (Arrow datasets, Hugging Face checkpoints) published atomically.

Stages exchange small frozen `ArtifactRef`s; the store maps a stage key to a complete artifact or to nothing.

Layout under the store root (a local folder or any fsspec URI):

    artifacts/{key[:2]}/{key}/                   one complete artifact: content files + manifest.json (written last)
    artifacts/{key[:2]}/.tmp-{key}-{uuid}/       a publish in progress, or the leftover of a crashed one (`sweep()`)
    artifacts/{key[:2]}/.tmp-{key}-del-{uuid}/   local stores: an artifact being deleted (`delete()`), or the
                                                 leftover of a crashed delete (`sweep()`)
    tombstones/{key}                             how many times `key` was deleted (`generation()`); absent: never
    staging/{key}/                               local stores only: per-key working folder that survives retries
    checkpoints/{key}/                           remote stores only: the in-stage checkpoints of a stage being built
                                                 by Ray workers on any node (`node.Outbox`), removed at its publish

Modules, each with one job: `ref` (the ref type, constants, key rules), `keys` (stage keys, code version), `digest`
(content digests, external fingerprints), `fsio` (fsync, writeback, moves), `manifest` (manifest.json), `store`
(`ArtifactStore`, the public API) over `local` (atomic rename) and `remote` (fsspec), `gc` (what to delete), `cache`
(a machine's copies of a remote store's artifacts) and `node` (artifacts as a Ray worker reads and writes them on
whichever node it runs).
"""

from posttrain_core.artifacts.digest import DIGEST_PREFIX, content_digest
from posttrain_core.artifacts.fsio import start_writeback
from posttrain_core.artifacts.keys import canonical_json, code_version, stage_key
from posttrain_core.artifacts.manifest import STORE_FIELDS
from posttrain_core.artifacts.ref import (
    EXTERNAL_PREFIX,
    KINDS,
    MANIFEST,
    SCHEMA_KINDS,
    TMP_PREFIX,
    ArtifactRef,
    Kind,
    ref_from_manifest,
)
from posttrain_core.artifacts.store import TOMBSTONES, ArtifactStore

__all__ = [
    "DIGEST_PREFIX",
    "EXTERNAL_PREFIX",
    "KINDS",
    "MANIFEST",
    "SCHEMA_KINDS",
    "STORE_FIELDS",
    "TMP_PREFIX",
    "TOMBSTONES",
    "ArtifactRef",
    "ArtifactStore",
    "Kind",
    "canonical_json",
    "code_version",
    "content_digest",
    "ref_from_manifest",
    "stage_key",
    "start_writeback",
]
