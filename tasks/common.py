"""What every stage task shares: the store, the cache key (= the stage key), retry rules and the summary artifact."""

from __future__ import annotations

import contextvars
import hashlib
import logging
import re
from collections.abc import Callable
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.tasks import exponential_backoff

from posttrain_core import tracking
from posttrain_core.artifacts import ArtifactRef, ArtifactStore

RETRY = dict(retries=2, retry_delay_seconds=exponential_backoff(backoff_factor=2), retry_jitter_factor=0.2)


def store_at(root: str | None) -> ArtifactStore:
    return ArtifactStore(root)


def is_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Retry lost Ray workers and node faults; never config or data errors (they fail the same way again)."""
    exc = getattr(state, "data", None)
    if isinstance(exc, ValueError | TypeError | FileNotFoundError | KeyError | NotImplementedError):
        return False
    try:
        from ray.exceptions import (
            ActorDiedError,
            ActorUnavailableError,
            NodeDiedError,
            RayActorError,
            WorkerCrashedError,
        )

        return isinstance(
            exc, RayActorError | ActorDiedError | ActorUnavailableError | WorkerCrashedError | NodeDiedError
        )
    except ImportError:
        return False


def stage_cache(key_of: Callable[[dict[str, Any], ArtifactStore], str]) -> Callable[[Any, dict[str, Any]], str | None]:
    """A Prefect `cache_key_fn` equal to the core stage key (plus the store's identity and deletion generation).

    The store is part of the key, so two stores never share records; Prefect's result records live inside the
    default store (`env.apply_defaults`), so wiping the store wipes them too. Once the artifact was deleted
    (`posttrain artifacts gc`), `-g{n}` (n = `ArtifactStore.generation(key)`) is appended: the record holding the ref
    of the deleted artifact is never hit again, and the task rebuilds the artifact under the same core key.
    """

    def cache_key_fn(context: Any, parameters: dict[str, Any]) -> str | None:
        store = store_at(parameters.get("store_root"))
        key = key_of(parameters, store)
        deleted = store.generation(key)
        suffix = f"-g{deleted}" if deleted else ""
        return f"{key}-{hashlib.sha256(str(store.root).encode()).hexdigest()[:12]}{suffix}"

    return cache_key_fn


def run_core(
    label: str, store_root: str | None, parent_run_id: str | None, run: Callable[[ArtifactStore], ArtifactRef]
) -> ArtifactRef:
    """What every stage task does: run the core stage function `run(store)` under the flow's MLflow run, then
    `report` its artifact as `label` (the task run's name, e.g. "rl_update[iter=3]")."""
    store = store_at(store_root)
    with tracking.parent(parent_run_id):
        ref = run(store)
    report(label, ref, store)
    return ref


def report(stage: str, ref: ArtifactRef, store: ArtifactStore) -> dict[str, Any]:
    """Log the stage's result and publish a Prefect table artifact with its metrics, key and MLflow run.

    The artifact is posted by the tracking writer (`tracking.in_background`), with this task run's context, so it is
    attached to this task run without its API calls sitting between two stages.
    """
    from prefect.context import TaskRunContext

    manifest = store.manifest(ref)
    metrics = manifest.get("metrics", {})
    rows = [{"name": k, "value": round(v, 6) if isinstance(v, float) else v} for k, v in metrics.items()]
    rows += [
        {"name": "artifact_key", "value": ref.key},
        {"name": "artifact_uri", "value": ref.uri},
        {"name": "mlflow_run_id", "value": manifest.get("mlflow_run_id")},
    ]
    if TaskRunContext.get() is None:  # outside a Prefect run (e.g. `.fn()` in a unit test)
        logging.getLogger(__name__).info("%s -> %s", stage, ref.uri)
        return manifest
    get_run_logger().info("%s -> %s %s", stage, ref.uri, {k: rows[i]["value"] for i, k in enumerate(metrics)})
    key = re.sub(r"[^a-z0-9]+", "-", stage.lower()).strip("-") + "-result"  # Prefect's artifact-key alphabet
    context = contextvars.copy_context()
    tracking.in_background(
        f"create the Prefect artifact {key}",
        lambda: context.run(create_table_artifact, rows, key=key, description=stage),
    )
    return manifest


def stage_task(name: str, key_of: Callable[[dict[str, Any], ArtifactStore], str], run_name: str | None = None):
    """The decorator every stage task shares: cache key = stage key, persisted result, retries on transient faults.

    Args:
        name: task name.
        key_of: (task parameters, store) -> the core stage key.
        run_name: task-run name template, e.g. "rollout[iter={iteration}]" (default: the name).
    """
    return task(
        name=name,
        task_run_name=run_name or name,
        cache_key_fn=stage_cache(key_of),
        persist_result=True,
        retry_condition_fn=is_transient,
        **RETRY,
    )
