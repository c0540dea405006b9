"""The stage contract in one function: key, cache lookup, tracking, staging, atomic publish.

Every stage (data preparation, model build, pretraining, SFT, evaluation, ...) is `run_stage(...)` plus a `build`
function that writes the artifact's content into a fresh folder; this module makes them all resumable and cached.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from posttrain_core import tracking
from posttrain_core.artifacts import ArtifactRef, ArtifactStore
from posttrain_core.artifacts.keys import stage_key

log = logging.getLogger(__name__)


@dataclass
class StageContext:
    """What a stage's build function gets.

    Attributes:
        key: the stage key.
        store: the artifact store.
        workdir: a local folder that persists across attempts of this stage (in-stage checkpoints live here).
        outdir: a fresh folder for the artifact's content; published atomically when build returns.
        tracker: the stage's MLflow run.
    """

    key: str
    store: ArtifactStore
    workdir: Path
    outdir: Path
    tracker: tracking.RunLogger


@dataclass
class StageOutput:
    """What a build function returns: manifest fields (per-kind extras) and the stage's summary metrics, and for a
    remote store the content when a Ray worker uploaded it (`artifacts.node.Outbox`) instead of writing `outdir`."""

    manifest: dict[str, Any]
    metrics: dict[str, float]
    uploaded: Any = None


def key_for(stage: str, cfg: BaseModel, inputs: Mapping[str, ArtifactRef]) -> str:
    """The stage key: the config (with the source of any user code it names), the inputs' digests, the code version."""
    code = user_code(cfg)
    config = {"config": cfg.model_dump(mode="json"), "user_code": code} if code else cfg
    return stage_key(stage, config, [ref.digest for ref in inputs.values()])


def user_code(cfg: BaseModel) -> dict[str, str]:
    """reference -> sha256 of its source, for the user code `cfg` names (`plugins`); empty for none."""
    from posttrain_core.plugins import source_digest

    refs = cfg.code_refs() if hasattr(cfg, "code_refs") else []
    return {ref: source_digest(ref, f"{type(cfg).__name__}") for ref in refs}


def check_inputs(stage: str, inputs: Mapping[str, ArtifactRef], store: ArtifactStore) -> None:
    """Every input must still be what its ref says: present in the store, or (external) unchanged on disk."""
    for name, ref in inputs.items():
        if ref.external:
            now = store.register_external(ref.uri, kind=ref.kind).digest
            if now != ref.digest:
                raise ValueError(
                    f"{stage}: input '{name}' at {ref.uri} changed since it was registered; re-run from the start"
                )
        elif store.get(ref.key) is None and not _complete_at(ref.uri):
            deleted = store.generation(ref.key)
            cause = (
                f"it was deleted from the store ({deleted}x), e.g. by `posttrain artifacts gc`."
                if deleted
                else "was it deleted by `posttrain artifacts gc`, or the store modified by hand?"
            )
            raise FileNotFoundError(
                f"{stage}: input '{name}' (artifact {ref.key[:12]}) is missing at {ref.uri}; {cause} "
                "A rerun of the flow that produced it rebuilds it."
            )


def _complete_at(uri: str) -> bool:
    """An artifact of another store is usable as an input when its manifest is there."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(uri)
    return fs.exists(f"{path.rstrip('/')}/manifest.json")


def run_stage(
    stage: str,
    cfg: BaseModel,
    inputs: Mapping[str, ArtifactRef],
    store: ArtifactStore,
    kind: Literal["dataset", "model"],
    build: Callable[[StageContext], StageOutput],
    schema_kind: str | None = None,
) -> ArtifactRef:
    """Return the stage's artifact: from the store if it is already there, else build and publish it.

    Args:
        stage: stage name (part of the key; also the MLflow run name).
        cfg: the stage's config (part of the key).
        inputs: named input artifacts (their digests are part of the key).
        store: where artifacts live.
        kind: "dataset" or "model".
        build: writes the content into `ctx.outdir`; may checkpoint into `ctx.workdir` and resume from it.
        schema_kind: for datasets, the Arrow schema kind.
    """
    check_inputs(stage, inputs, store)
    key = key_for(stage, cfg, inputs)
    cached = store.get(key)
    if cached is not None:
        log.info("%s: cache hit %s (nothing to run)", stage, key[:12])
        return cached
    with build_lock(store, key, stage):
        cached = store.get(key)
        if cached is not None:  # a concurrent run published it while this one waited
            log.info("%s: %s was published by a concurrent run; reusing it", stage, key[:12])
            return cached
        return _build(stage, cfg, inputs, store, kind, build, schema_kind, key)


@contextlib.contextmanager
def build_lock(store: ArtifactStore, key: str, stage: str, poll_s: float = 1.0) -> Iterator[None]:
    """Hold the machine-wide lock of one stage key while building it: concurrent runs of the same stage on this
    machine (two deployments at once, or two threads) build it once; the others wait, then reuse the artifact.

    An `flock` on `{staging}/locks/{key}`: the kernel releases it when its holder dies, so a crashed builder never
    blocks the next one (which then resumes from the crashed one's in-stage checkpoints). Runs on other machines
    sharing a remote store are not serialised: each builds, and the store keeps the first publish.
    """
    fd = _open_lock(store, key)
    try:
        waited, last_note = 0.0, 0.0
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if waited - last_note >= 30 or waited == 0:
                    log.info("%s: %s is being built by another run on this machine; waiting (%.0f s)", stage,
                             key[:12], waited)  # fmt: skip
                    last_note = waited
                time.sleep(poll_s)
                waited += poll_s
        yield
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def try_build_lock(store: ArtifactStore, key: str) -> Iterator[bool]:
    """Take the build lock of `key` (see `build_lock`) without waiting: yields True while holding it, False when a
    build of that key is running on this machine (nothing is held then). `posttrain artifacts gc` deletes under it."""
    fd = _open_lock(store, key)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
        else:
            yield True
    finally:
        os.close(fd)


def _open_lock(store: ArtifactStore, key: str) -> int:
    folder = Path(store.staging_root) / "locks"
    folder.mkdir(parents=True, exist_ok=True)
    return os.open(folder / key, os.O_RDWR | os.O_CREAT, 0o644)


def _ray_cluster() -> dict[str, str]:
    """Where the stage's Ray work ran (the GCS address of the cluster this process joined), for the manifest."""
    import sys

    ray = sys.modules.get("ray")  # a stage that never touched Ray has nothing to record (and must not import it)
    if ray is None or not ray.is_initialized():
        return {}
    return {"ray_address": ray.get_runtime_context().gcs_address}


def _build(stage, cfg, inputs, store, kind, build, schema_kind, key) -> ArtifactRef:
    log.info("%s: building %s", stage, key[:12])
    started = time.time()
    with tracking.stage_run(
        store.root, stage, {"config": cfg.model_dump(mode="json")}, tags={"posttrain.key": key}
    ) as tracker:
        tracking.log_inputs(tracker, inputs)
        ctx = StageContext(key, store, store.staging_dir(key), store.new_output_dir(key), tracker)
        out = build(ctx)
        manifest = {
            "stage": stage,
            "config": cfg.model_dump(mode="json"),
            **({"user_code": code} if (code := user_code(cfg)) else {}),
            "inputs": [{"name": name, **ref.model_dump()} for name, ref in inputs.items()],
            "mlflow_run_id": tracker.run_id,
            "metrics": out.metrics,
            "duration_s": round(time.time() - started, 3),
            **_ray_cluster(),
            **out.manifest,
        }
        ref = store.publish(key, kind, out.uploaded or ctx.outdir, manifest, schema_kind=schema_kind)
        tracker.log_dict(store.manifest(ref), "manifest.json")
        tracker.log_batch({f"final/{k}": v for k, v in out.metrics.items()}, tags={"posttrain.artifact_uri": ref.uri})
    store.clear_staging(key)
    log.info("%s: published %s in %.1fs", stage, ref.uri, time.time() - started)
    return ref
