"""Artifacts as a Ray worker sees them on whichever node it runs: what it reads (`NodePath`) and where it writes
(`Outbox`). Nothing here assumes that the node shares a folder with the flow's machine.

- A local store is one folder that every node mounts at the same path (a single machine, or NFS): workers read the
  artifacts and write the stage's output folder and in-stage checkpoints in place, as the driver does.
- A remote store (`s3://...`): each node downloads the inputs it needs into its own cache (`$POSTTRAIN_CACHE_DIR`,
  verified by digest, bounded by `cache.trim`); a worker writes into its node's staging folder, uploads the stage's
  output into a temp folder of the store (`Outbox.ship`), and the driver commits it with the usual manifest-last
  publish. In-stage checkpoints go to the store too (`checkpoints/{key}/`), so a stage retried on another node
  resumes from the newest of them.

Jobs carry these small picklable objects instead of paths; `on_node(job)` turns them into this node's paths.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import posixpath
import shutil
import uuid
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from posttrain_core.artifacts.ref import ArtifactRef

log = logging.getLogger(__name__)


@cache
def node_store(root: str) -> Any:
    """This process's `ArtifactStore` for `root` (its cache and staging: this node's, see `ArtifactStore`)."""
    from posttrain_core.artifacts.store import ArtifactStore

    return ArtifactStore(root)


@dataclass(frozen=True)
class NodePath:
    """An artifact, or the file or folder `sub` inside it, for a Ray worker to read on its own node."""

    root: str  # the store's root
    ref: ArtifactRef
    sub: str = ""

    def path(self) -> str:
        """The local path on this node (a remote artifact is downloaded into the node's cache first)."""
        folder = node_store(self.root).local_path(self.ref)
        return str(folder / self.sub) if self.sub else str(folder)

    def __str__(self) -> str:  # in log lines and errors: where it comes from
        return f"{self.ref.uri}/{self.sub}" if self.sub else self.ref.uri


def at(path: str | NodePath | None) -> str | None:
    """A path a job field holds, on this node: a plain path as it is, a `NodePath` resolved here."""
    return path.path() if isinstance(path, NodePath) else path


@dataclass(frozen=True)
class Outbox:
    """Where a stage's Ray workers write, for a remote store: this node's staging folder for the stage key, whose
    output reaches the store by `ship`, and whose in-stage checkpoints are kept in the store (`keep`, `restore`)."""

    root: str
    key: str

    def workdir(self) -> Path:
        return node_store(self.root).staging_dir(self.key)

    def outdir(self) -> Path:
        return self.workdir() / "out"

    def ship(self, folder: str | os.PathLike) -> Any:
        """Upload the output folder into a temp folder of the store and remove this node's staging of the stage;
        returns the `remote.Uploaded` the driver publishes (`ArtifactStore.publish`)."""
        from posttrain_core.artifacts import remote

        up = remote.upload(node_store(self.root), self.key, Path(folder))
        # This node's staging for the stage (the output, rank 0's local checkpoints) is done with: a retry resumes
        # from the store's checkpoints, which the driver removes once it has published.
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(self.workdir(), ignore_errors=True)
        log.info("uploaded the output of %s (%d files) to %s", self.key[:12], len(up.files), up.tmp)
        return up

    def keep(self, checkpoint: Path, keep_last: int) -> None:
        """Copy an in-stage checkpoint file into the store (an object appears whole or not at all), and drop the
        store's copies older than the newest `keep_last`."""
        store = node_store(self.root)
        prefix = store.checkpoint_prefix(self.key)
        store.fs.makedirs(prefix, exist_ok=True)
        store.fs.put_file(str(checkpoint), f"{prefix}/{checkpoint.name}")
        for old in self._stored()[:-keep_last]:
            store.fs.rm_file(f"{prefix}/{old}")

    def restore(self, folder: Path) -> str | None:
        """Download the store's newest in-stage checkpoint into `folder` unless it is there already; its name."""
        names = self._stored()
        if not names:
            return None
        newest, dest = names[-1], folder / names[-1]
        if not dest.exists():
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / f".{newest}.{uuid.uuid4().hex}.tmp"
            store = node_store(self.root)
            store.fs.get_file(f"{store.checkpoint_prefix(self.key)}/{newest}", str(tmp))
            os.replace(tmp, dest)
            log.info("in-stage checkpoint %s of %s fetched from the store", newest, self.key[:12])
        return newest

    def _stored(self) -> list[str]:
        store = node_store(self.root)
        try:
            entries = store.fs.ls(store.checkpoint_prefix(self.key), detail=False)
        except FileNotFoundError:
            return []
        return sorted(n for n in (posixpath.basename(e.rstrip("/")) for e in entries) if n.startswith("step_"))


def outbox_of(store: Any, key: str) -> Outbox | None:
    """The outbox of a stage's workers: None for a local store (every node writes the driver's folders in place)."""
    return None if store.is_local else Outbox(store.root, key)


def node_path(store: Any, ref: ArtifactRef, sub: str = "") -> NodePath:
    """`ref` (or `sub` inside it) as the Ray workers of `store` read it."""
    return NodePath(store.root, ref, sub)


def on_node(job: Any, fetch: bool = True) -> Any:
    """A job dataclass as this node sees it: every `NodePath` field resolved to a local path (downloaded here when
    the store is remote; left as it is when `fetch` is False), and with an `outbox` its `workdir` and `outdir` this
    node's staging folders, the store's newest in-stage checkpoint fetched into `workdir/checkpoints`."""
    changes: dict[str, Any] = {}
    if fetch:
        changes = {f.name: v.path() for f in dataclasses.fields(job) if isinstance(v := getattr(job, f.name), NodePath)}
    outbox = getattr(job, "outbox", None)
    if outbox is not None:
        workdir = outbox.workdir()
        shutil.rmtree(outbox.outdir(), ignore_errors=True)  # what a killed attempt left unshipped
        outbox.restore(workdir / "checkpoints")
        changes["outdir"] = str(outbox.outdir())
        if "workdir" in {f.name for f in dataclasses.fields(job)}:
            changes["workdir"] = str(workdir)
    return dataclasses.replace(job, **changes) if changes else job
