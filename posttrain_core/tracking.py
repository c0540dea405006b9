"""MLflow tracking: one parent run per flow run, one nested run per stage, step metrics from rank 0.

Everything goes through an explicit `MlflowClient` and run ids (no fluent active-run state), so stages running in
Prefect task threads and Ray workers in other processes can all log to the right run.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from posttrain_core.env import apply_defaults

log = logging.getLogger(__name__)

_PARENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("posttrain_parent_run", default=None)
_EXPERIMENT: contextvars.ContextVar[str] = contextvars.ContextVar("posttrain_experiment", default="posttrain")


def tracking_uri(store_root: str | os.PathLike | None = None) -> str:
    """`$MLFLOW_TRACKING_URI`, else a SQLite file in the (local) store root."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    root = Path(store_root) if store_root and "://" not in str(store_root) else Path(".posttrain")
    root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root.resolve()}/mlflow.db"


def client(store_root: str | os.PathLike | None = None):
    apply_defaults()
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri(store_root))


def experiment_id(store_root: str | os.PathLike | None, name: str) -> str:
    """Get or create the experiment; its artifacts go into the store (not ./mlruns of the current folder)."""
    c = client(store_root)
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    location = None
    if not os.environ.get("MLFLOW_TRACKING_URI") and store_root and "://" not in str(store_root):
        location = (Path(store_root).resolve() / "mlruns").as_uri()
    try:
        return c.create_experiment(name, artifact_location=location)
    except Exception:  # created concurrently
        return c.get_experiment_by_name(name).experiment_id


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config dict -> {"a.b": "value"} (MLflow params are flat strings, 6000 chars max)."""
    out: dict[str, str] = {}
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, name + "."))
        else:
            out[name] = (json.dumps(v) if not isinstance(v, str) else v)[:6000]
    return out


class RunLogger:
    """Logs params, metrics and artifacts to one MLflow run by id (picklable: safe to send to a Ray worker)."""

    def __init__(self, uri: str, run_id: str):
        self.uri, self.run_id = uri, run_id

    def _client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.uri)

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)) for k, v in flatten(params).items()]
        for i in range(0, len(items), 100):
            self._client().log_batch(self.run_id, params=items[i : i + 100])

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        items = [Metric(k, float(v), ts, step or 0) for k, v in metrics.items() if v is not None]
        if items:
            self._client().log_batch(self.run_id, metrics=items)

    def log_dict(self, obj: Any, name: str) -> None:
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / name
            path.write_text(json.dumps(obj, indent=2, default=str))
            self._client().log_artifact(self.run_id, str(path))

    def log_artifact(self, path: str | os.PathLike) -> None:
        self._client().log_artifact(self.run_id, str(path))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        for k, v in tags.items():
            self._client().set_tag(self.run_id, k, str(v))


@contextlib.contextmanager
def flow_run(
    store_root: str | os.PathLike | None, experiment: str, name: str, tags: Mapping[str, Any] | None = None
) -> Iterator[RunLogger]:
    """The parent run of one flow run; stages started inside (same thread or passed `parent_run_id`) nest under it."""
    c = client(store_root)
    exp = experiment_id(store_root, experiment)
    run = c.create_run(exp, run_name=name, tags={k: str(v) for k, v in (tags or {}).items()})
    logger = RunLogger(tracking_uri(store_root), run.info.run_id)
    token, etoken = _PARENT.set(run.info.run_id), _EXPERIMENT.set(experiment)
    status = "FAILED"
    try:
        yield logger
        status = "FINISHED"
    finally:
        _PARENT.reset(token)
        _EXPERIMENT.reset(etoken)
        c.set_terminated(run.info.run_id, status)


@contextlib.contextmanager
def parent(run_id: str | None, experiment: str | None = None) -> Iterator[None]:
    """Make `run_id` the parent of stage runs started in this context (used by Prefect tasks)."""
    token = _PARENT.set(run_id)
    etoken = _EXPERIMENT.set(experiment) if experiment else None
    try:
        yield
    finally:
        _PARENT.reset(token)
        if etoken is not None:
            _EXPERIMENT.reset(etoken)


def current_parent() -> str | None:
    return _PARENT.get()


@contextlib.contextmanager
def stage_run(
    store_root: str | os.PathLike | None, stage: str, params: Mapping[str, Any], tags: Mapping[str, Any] | None = None
) -> Iterator[RunLogger]:
    """A run for one stage, nested under the current parent run if there is one; marked FAILED on error."""
    c = client(store_root)
    parent_id = _PARENT.get()
    exp = c.get_run(parent_id).info.experiment_id if parent_id else experiment_id(store_root, _EXPERIMENT.get())
    all_tags = {"posttrain.stage": stage, **{k: str(v) for k, v in (tags or {}).items()}}
    if parent_id:
        all_tags["mlflow.parentRunId"] = parent_id
    run = c.create_run(exp, run_name=stage, tags=all_tags)
    logger = RunLogger(tracking_uri(store_root), run.info.run_id)
    logger.log_params(params)
    status = "FAILED"
    try:
        yield logger
        status = "FINISHED"
    finally:
        c.set_terminated(run.info.run_id, status)


def log_inputs(logger: RunLogger, inputs: Mapping[str, Any]) -> None:
    """Record the stage's input artifacts as MLflow dataset inputs (name, uri, digest; context = input name)."""
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.data.sources import LocalArtifactDatasetSource
    from mlflow.entities import DatasetInput, InputTag

    datasets = []
    for name, ref in inputs.items():
        ds = MetaDataset(LocalArtifactDatasetSource(ref.uri), name=f"{name}:{ref.key[:12]}", digest=ref.digest[:36])
        datasets.append(DatasetInput(ds._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", name)]))
    if datasets:
        logger._client().log_inputs(logger.run_id, datasets=datasets)
