"""The tracking writer: one background thread per process writes the tracking records in the order they were made.
`flush()` waits for every record made before it; `client()` flushes first, so reads through it see them all."""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from posttrain_core.tracking import process
from posttrain_core.tracking.backend import _init_sqlite_once, _unflushed_client

log = logging.getLogger(__name__)


class _Writer:
    """One daemon thread that runs tracking writes in submission order.

    A stage's records (its run's creation, params, inputs, metrics, its manifest, closing tags and status) are SQLite
    commits of 3-9 ms each, ~25 ms per stage: written here, they do not sit between one stage and the next. The lag is
    bounded: `flush()` waits for every record made before, the flow's run flushes before it ends, and so does the
    process at exit.

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


def _writer_client(uri: str) -> process.RemoteClient:
    """The client of the writer thread's records: its calls run in the helper process (`process`)."""
    _init_sqlite_once(uri)  # created and migrated here, under the file lock, before the helper opens it
    return process.RemoteClient(uri)
