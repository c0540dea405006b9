"""MLflow runs: one parent run per flow run, one nested run per stage, and `RunLogger`, which logs to a run by id.
Explicit clients and run ids (no fluent active-run state): Prefect task threads and Ray workers log to the right run."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from posttrain_core.env import apply_defaults, setting
from posttrain_core.tracking import process
from posttrain_core.tracking.backend import _unflushed_client, tracking_uri
from posttrain_core.tracking.orphans import _owner_tags, end_orphaned_runs
from posttrain_core.tracking.writer import _WRITER, _writer_client, client, flush

log = logging.getLogger(__name__)

_NOT_IN_NAMES = re.compile(r"[^A-Za-z0-9_\-. /]")


def metric_name(key: str) -> str:
    """MLflow's name for a posttrain metric: MLflow refuses '@' and most punctuation ('pass@1' -> 'pass_at_1')."""
    return _NOT_IN_NAMES.sub("_", key.replace("@", "_at_"))


_PARENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("posttrain_parent_run", default=None)
_EXPERIMENT: contextvars.ContextVar[str] = contextvars.ContextVar("posttrain_experiment", default="posttrain")


def experiment_id(store_root: str | os.PathLike | None, name: str) -> str:
    """Get or create the experiment; its artifacts go into the store (not ./mlruns of the current folder)."""
    c = client(store_root)
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    location = None
    if not setting("MLFLOW_TRACKING_URI") and store_root and "://" not in str(store_root):
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
    """Logs params, metrics and artifacts to one MLflow run by id (picklable: safe to send to a Ray worker).

    With `background=True` (the loggers of `flow_run` and `stage_run`) each call only captures its values and queues
    the write on the tracking writer (`writer`); a write that fails is logged, not raised. Without it every call
    writes before returning. `run_id` may be the Future of a run being created on the writer (`stage_run`): writes
    queued after the creation find it done; reading `run_id` elsewhere waits for it (and raises if the creation
    failed).
    """

    def __init__(self, uri: str, run_id: str | Future, background: bool = False, label: str = ""):
        self.uri, self._run_id, self.background = uri, run_id, background
        self.label = label or (run_id if isinstance(run_id, str) else "a stage")

    @property
    def run_id(self) -> str:
        if isinstance(self._run_id, Future):
            self._run_id = self._run_id.result()
        return self._run_id

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_run_id": self.run_id}

    def _client(self):
        if self.background:  # on the writer thread
            return _writer_client(self.uri)
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.uri)

    def _write(self, what: str, fn: Callable[[], Any]) -> None:
        if self.background:
            _WRITER.submit(f"{what} of run {self.label}", fn)
        else:
            fn()

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)) for k, v in flatten(params).items()]

        def write() -> None:
            for i in range(0, len(items), 100):
                self._client().log_batch(self.run_id, params=items[i : i + 100])

        self._write("log params", write)

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        self.log_batch(metrics=metrics, step=step)

    def log_batch(
        self, metrics: Mapping[str, float] | None = None, tags: Mapping[str, Any] | None = None, step: int | None = None
    ) -> None:
        """Metrics and tags in one write (one SQLite transaction instead of two)."""
        from mlflow.entities import Metric, RunTag

        ts = int(time.time() * 1000)
        items = [Metric(metric_name(k), float(v), ts, step or 0) for k, v in (metrics or {}).items() if v is not None]
        tag_items = [RunTag(k, str(v)) for k, v in (tags or {}).items()]
        if items or tag_items:
            what = "log metrics" if not tag_items else "set tags" if not items else "log metrics and tags"
            self._write(what, lambda: self._client().log_batch(self.run_id, metrics=items, tags=tag_items))

    def log_dict(self, obj: Any, name: str) -> None:
        text = json.dumps(obj, indent=2, default=str)  # now: the caller may change `obj` after this returns
        # The text travels with the call, not as a temporary file: a write still queued when the process exits would
        # find its file already deleted (interpreter shutdown runs temporary-folder finalizers before the exit-time
        # flush), and the helper process writes its own copy anyway.
        self._write(f"log {name}", lambda: self._client().log_text(self.run_id, text, name))

    def log_artifact(self, path: str | os.PathLike) -> None:
        """Copies the file at `path`, which must stay as it is until `flush()` when the logger is `background`."""
        self._write(f"log artifact {path}", lambda: self._client().log_artifact(self.run_id, str(path)))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        self.log_batch(tags=tags)


@contextlib.contextmanager
def _ended(c, run: RunLogger, background: bool = False) -> Iterator[None]:
    """End the run when the block exits: FINISHED; FAILED for an error; KILLED for a cancellation (a BaseException:
    Prefect's termination signal, Ctrl-C, exit). `background`: queue the write on the tracking writer."""
    status = "KILLED"
    try:
        yield
        status = "FINISHED"
    except Exception as err:
        status = "KILLED" if _interrupted(err) else "FAILED"
        raise
    finally:
        if background:
            _WRITER.submit(f"end run {run.label} ({status})", lambda: c.set_terminated(run.run_id, status))
        else:
            c.set_terminated(run.run_id, status)


def _interrupted(err: BaseException) -> bool:
    """True when an error was raised by a cancellation: a termination signal delivered while Ray's Cython code ran
    surfaces as `SystemError(... returned a result with an exception set)` whose context is the signal's exception
    (Prefect's TerminationSignal, KeyboardInterrupt, SystemExit)."""
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        if not isinstance(cause, Exception):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False


@contextlib.contextmanager
def flow_run(
    store_root: str | os.PathLike | None, experiment: str, name: str, tags: Mapping[str, Any] | None = None
) -> Iterator[RunLogger]:
    """The parent run of one flow run; stages started inside (same thread or passed `parent_run_id`) nest under it.

    Ends FINISHED, FAILED (an exception) or KILLED (cancelled: a BaseException such as Prefect's termination
    signal); runs left RUNNING by killed processes of this host are ended first (`end_orphaned_runs`).
    """
    process.prestart()  # the stages' records go through it: its MLflow import overlaps this flow's start
    end_orphaned_runs(store_root)
    c = client(store_root)
    exp = experiment_id(store_root, experiment)
    run_tags = {**_owner_tags(), **{k: str(v) for k, v in (tags or {}).items()}}
    run = c.create_run(exp, run_name=name, tags=run_tags)
    logger = RunLogger(tracking_uri(store_root), run.info.run_id, background=True)
    token, etoken = _PARENT.set(run.info.run_id), _EXPERIMENT.set(experiment)
    try:
        with _ended(c, logger):
            try:
                yield logger
            finally:  # the stages' records are written before the flow's run ends
                errors = flush()
                if errors:
                    log.warning("%d tracking writes of this flow run failed (first: %s)", len(errors), errors[0])
                    c.set_tag(run.info.run_id, "posttrain.tracking_errors", str(len(errors)))
    finally:
        _PARENT.reset(token)
        _EXPERIMENT.reset(etoken)


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


@functools.lru_cache(maxsize=256)
def _experiment_of(store_root: str | os.PathLike | None, run_id: str) -> str:
    """The experiment of a run: fixed for the run's life, so looked up once per process, not once per stage. A parent
    run is created synchronously (`flow_run`), so this reads it without waiting for the writer."""
    return _unflushed_client(store_root).get_run(run_id).info.experiment_id


@contextlib.contextmanager
def stage_run(
    store_root: str | os.PathLike | None, stage: str, params: Mapping[str, Any], tags: Mapping[str, Any] | None = None
) -> Iterator[RunLogger]:
    """A run for one stage, nested under the current parent run if there is one; FAILED on error, KILLED when
    cancelled (as `flow_run`).

    The run is created on the writer too, after the earlier stages' records, and the block starts at once, so the
    writer's backlog (the previous stage's records) does not sit between one stage and the next: the run's id (for
    the artifact's manifest) is `logger.run_id`, which waits for the creation.
    """
    apply_defaults()
    c = _writer_client(tracking_uri(store_root))  # the run is created on the writer, after the records queued before it
    parent_id = _PARENT.get()
    exp = _experiment_of(store_root, parent_id) if parent_id else experiment_id(store_root, _EXPERIMENT.get())
    all_tags = {"posttrain.stage": stage, **_owner_tags(), **{k: str(v) for k, v in (tags or {}).items()}}
    if parent_id:
        all_tags["mlflow.parentRunId"] = parent_id
    run = _WRITER.submit(
        f"create the {stage} run", lambda: c.create_run(exp, run_name=stage, tags=all_tags).info.run_id, report=False
    )
    logger = RunLogger(tracking_uri(store_root), run, background=True, label=stage)
    logger.log_params(params)
    with _ended(c, logger, background=True):
        yield logger


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
        logger._write("log inputs", lambda: logger._client().log_inputs(logger.run_id, datasets=datasets))
