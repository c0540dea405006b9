"""MLflow tracking: one parent run per flow run, one nested run per stage, step metrics from rank 0.

Everything goes through an explicit `MlflowClient` and run ids (no fluent active-run state), so stages running in
Prefect task threads and Ray workers in other processes can all log to the right run.

A stage's records (its run's creation, params, inputs, metrics, its manifest, closing tags and status) are written
by one background thread per process, in the order they were made (`_Writer`): each is a SQLite commit of 3-9 ms,
~25 ms per stage, which no longer sits between one stage and the next. The thread hands the MLflow calls to a helper
process (`tracking_process`), so that work does not hold this process's GIL either. The lag is bounded: `flush()`
waits for every record made before, the flow's run flushes before it ends, and so does the process at exit.
`client()` flushes first, so reads through it see every record made before.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import functools
import json
import logging
import os
import queue
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from posttrain_core import tracking_process
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


class _Writer:
    """One daemon thread that runs tracking writes in submission order.

    A failed write is logged and counted (`errors`), never raised into the stage that made it: the stage's artifact
    and manifest are already safe, and a tracking hiccup must not fail the training behind them. The Future that
    `submit` returns settles after every write submitted before it (`stage_run` reads its run id from one).
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[str, Callable[[], Any], Future, bool]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.errors: list[str] = []

    def submit(self, what: str, fn: Callable[[], Any], report: bool = True) -> Future:
        """Queue `fn`; `report`: log and count its failure (a write nobody waits for)."""
        future: Future = Future()
        if threading.current_thread() is self._thread:  # a write made by a write: run it now (no deadlock)
            self._run(what, fn, future, report)
            return future
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="posttrain-tracking", daemon=True)
                self._thread.start()
        self._queue.put((what, fn, future, report))
        return future

    def flush(self) -> list[str]:
        """Wait until every write submitted so far is done; returns the errors since the last flush."""
        if self._thread is not None and self._thread.is_alive() and threading.current_thread() is not self._thread:
            self.submit("flush", lambda: None, report=False).result()
        with self._lock:
            errors, self.errors = self.errors, []
        return errors

    def _loop(self) -> None:  # a daemon: ends with the process, after the exit-time flush
        while True:
            self._run(*self._queue.get())

    def _run(self, what: str, fn: Callable[[], Any], future: Future, report: bool) -> None:
        try:
            future.set_result(fn())
        except BaseException as err:  # noqa: BLE001 - recorded on the future; logged for fire-and-forget writes
            future.set_exception(err)
            if not report:
                return
            log.warning("tracking: could not %s: %s: %s", what, type(err).__name__, err)
            with self._lock:
                self.errors.append(f"{what}: {type(err).__name__}: {err}")


_WRITER = _Writer()
atexit.register(_WRITER.flush)


def in_background(what: str, fn: Callable[[], Any]) -> None:
    """Run a record-keeping call (e.g. a Prefect artifact) on the tracking writer, after the records queued before it;
    a failure is logged and counted like a failed MLflow write."""
    _WRITER.submit(what, fn)


def flush() -> list[str]:
    """Wait until this process's tracking records are all written; returns the writes that failed since the last
    flush (each also logged as a warning when it failed)."""
    return _WRITER.flush()


def client(store_root: str | os.PathLike | None = None):
    """An MLflow client on the store's tracking URI, after this process's pending records are written."""
    _WRITER.flush()
    return _unflushed_client(store_root)


def _writer_client(uri: str):
    """The client of the writer thread's records: the helper process's (`tracking_process`), or this process's."""
    _init_sqlite_once(uri)  # created and migrated here, under the file lock, before the helper opens it
    if tracking_process.enabled():
        return tracking_process.RemoteClient(uri)
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _unflushed_client(store_root: str | os.PathLike | None = None):
    """`client()` without waiting for pending records: for writers that are queued behind them anyway."""
    apply_defaults()
    from mlflow.tracking import MlflowClient

    uri = tracking_uri(store_root)
    _init_sqlite_once(uri)
    return MlflowClient(tracking_uri=uri)


_INITIALISED: set[str] = set()


def _init_sqlite_once(uri: str) -> None:
    """Create/migrate a SQLite tracking database under a file lock, once per process.

    Two processes opening a new database at once both run MLflow's schema creation and one fails ("table ...
    already exists"): seen with two flow runs started together on a fresh store.
    """
    if not uri.startswith("sqlite:///") or uri in _INITIALISED:
        return
    import fcntl

    from mlflow.tracking import MlflowClient

    db = Path(uri.removeprefix("sqlite:///"))
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{db}.init-lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        MlflowClient(tracking_uri=uri).search_experiments(max_results=1)  # creates the schema
    _INITIALISED.add(uri)


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


class MetricsFile:
    """Step metrics a training worker appends to a JSONL file, which the stage's driver relays to MLflow.

    Training workers never import MLflow: mlflow, SQLAlchemy and a SQLite connection cost a process ~175 MB of resident
    memory (measured: +115 MB import, +60 MB first logged batch); without them the rank-0 SFT worker's peak on the
    benchmark model fell 1,173 -> 1,082 MiB. The driver already has them, and logs what the workers wrote
    (`MetricsRelay`).
    Picklable (a path), so it crosses the Ray boundary.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        line = json.dumps({"step": step, "metrics": {k: float(v) for k, v in metrics.items() if v is not None}})
        with open(self.path, "a") as f:  # one short write per line: a reader sees whole lines or none
            f.write(line + "\n")


class MetricsRelay:
    """Logs the lines workers append to a `MetricsFile` into an MLflow run; call `pump()` while they run.

    Starts at the file's current end, so lines of an earlier attempt of the stage (a retry resumes in the same
    working folder) were logged to that attempt's run and are not logged again.
    """

    def __init__(self, path: str | os.PathLike, tracker: RunLogger):
        self.sink = MetricsFile(path)
        self.tracker = tracker
        self.offset = os.path.getsize(path) if os.path.exists(path) else 0

    @classmethod
    def in_folder(cls, folder: str | os.PathLike, tracker: RunLogger) -> MetricsRelay:
        """The relay of a stage's working folder (`metrics.jsonl` there): what the training stages use."""
        return cls(Path(folder) / "metrics.jsonl", tracker)

    def pump(self) -> int:
        """Log the complete lines written since the last call; returns how many. Never raises: a tracking hiccup
        must not fail the training it watches (the lines stay in the file)."""
        try:
            with open(self.sink.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return 0
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next call
        lines = data[:end].splitlines()
        try:
            for line in lines:
                item = json.loads(line)
                self.tracker.log_metrics(item["metrics"], step=item["step"])
        except Exception as e:  # noqa: BLE001
            log.warning("could not relay training metrics to MLflow: %s", e)
        self.offset += end
        return len(lines)


class RunLogger:
    """Logs params, metrics and artifacts to one MLflow run by id (picklable: safe to send to a Ray worker).

    With `background=True` (the loggers of `flow_run` and `stage_run`) each call only captures its values and queues
    the write (see `_Writer`); a write that fails is logged, not raised. Without it every call writes before
    returning. `run_id` may be the Future of a run being created on the writer (`stage_run`): writes queued after the
    creation find it done; reading `run_id` elsewhere waits for it (and raises if the creation failed).
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
        items = [Metric(k, float(v), ts, step or 0) for k, v in (metrics or {}).items() if v is not None]
        tag_items = [RunTag(k, str(v)) for k, v in (tags or {}).items()]
        if items or tag_items:
            what = "log metrics" if not tag_items else "set tags" if not items else "log metrics and tags"
            self._write(what, lambda: self._client().log_batch(self.run_id, metrics=items, tags=tag_items))

    def log_dict(self, obj: Any, name: str) -> None:
        text = json.dumps(obj, indent=2, default=str)  # now: the caller may change `obj` after this returns

        def write() -> None:
            with tempfile.TemporaryDirectory() as d:
                path = Path(d) / name
                path.write_text(text)
                self._client().log_artifact(self.run_id, str(path))

        self._write(f"log {name}", write)

    def log_artifact(self, path: str | os.PathLike) -> None:
        """Copies the file at `path`, which must stay as it is until `flush()` when the logger is `background`."""
        self._write(f"log artifact {path}", lambda: self._client().log_artifact(self.run_id, str(path)))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        self.log_batch(tags=tags)


def _owner_tags() -> dict[str, str]:
    """Which process owns a run: a run still RUNNING whose process is gone was killed (see `end_orphaned_runs`)."""
    import socket

    import psutil

    pid = os.getpid()
    return {
        "posttrain.host": socket.gethostname(),
        "posttrain.pid": str(pid),
        "posttrain.pid_started": f"{psutil.Process(pid).create_time():.2f}",
    }


def _process_alive(pid: int, started: str | None) -> bool:
    import psutil

    try:
        proc = psutil.Process(pid)
        return started is None or abs(proc.create_time() - float(started)) < 1.0  # not a reused pid
    except (psutil.NoSuchProcess, ValueError):
        return False


def end_orphaned_runs(store_root: str | os.PathLike | None) -> int:
    """Mark KILLED every RUNNING posttrain run of this host whose process no longer exists; return how many.

    A process killed with SIGKILL (or a machine that lost power) cannot end its MLflow runs; the next flow run on
    the same host (every `flow_run` calls this) ends them, tagged `posttrain.end_reason = process gone`. Runs of
    other hosts are left alone (their processes cannot be checked from here).
    """
    import socket

    c = client(store_root)
    host = socket.gethostname()
    ended = 0
    try:
        experiments = [e.experiment_id for e in c.search_experiments()]
        runs = c.search_runs(
            experiments, filter_string=f"attributes.status = 'RUNNING' and tags.`posttrain.host` = '{host}'"
        ) if experiments else []  # fmt: skip
    except Exception as err:  # a store that cannot be searched must not stop the flow
        log.warning("could not look for orphaned MLflow runs: %s", err)
        return 0
    for run in runs:
        pid = run.data.tags.get("posttrain.pid")
        if pid and not _process_alive(int(pid), run.data.tags.get("posttrain.pid_started")):
            c.set_tag(run.info.run_id, "posttrain.end_reason", "process gone")
            c.set_terminated(run.info.run_id, "KILLED")
            ended += 1
    if ended:
        log.warning("marked %d MLflow runs KILLED: their processes on %s are gone (killed or crashed)", ended, host)
    return ended


@contextlib.contextmanager
def _ended(c, run: RunLogger, background: bool = False) -> Iterator[None]:
    """End the run when the block exits: FINISHED; FAILED for an error; KILLED for a cancellation (a BaseException:
    Prefect's termination signal, Ctrl-C, exit). `background`: queue the write (see `_Writer`)."""
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
    tracking_process.prestart()  # the stages' records go through it: its MLflow import overlaps this flow's start
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

    The run is created on the writer too, after the earlier stages' records, and the block starts at once: its id
    (for the artifact's manifest) is `logger.run_id`, which waits for the creation. Creating it synchronously put the
    writer's backlog (the previous stage's records, ~40 ms) between one stage and the next.
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
