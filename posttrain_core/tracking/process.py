"""The tracking helper process: it runs the writer thread's MLflow calls, so their SQLite work is off our GIL.
`RemoteClient(uri)` has the `MlflowClient` methods; each call is pickled to the helper, and its result pickled back."""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
import threading
from typing import Any, BinaryIO

_HEADER = struct.Struct("<Q")

# `-c`, not `-m`: the package's __init__ imports this module, and runpy warns about (and re-runs) a module it finds
# already imported. `-u`: stray prints of the helper reach stderr at once.
_COMMAND = [sys.executable, "-u", "-c", "from posttrain_core.tracking.process import serve; serve()"]


def _send(stream: BinaryIO, obj: Any) -> None:
    _send_pickled(stream, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _send_pickled(stream: BinaryIO, data: bytes) -> None:
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _receive(stream: BinaryIO) -> Any:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError("the tracking process closed its pipe")
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the tracking process closed its pipe mid-message")
    return pickle.loads(data)


class _Helper:
    """The helper process of this process: started on first use, restarted after it dies.

    A stage's MLflow records are ~25 ms of SQLAlchemy and SQLite work; on the writer thread they would hold this
    process's GIL while the next stage runs. Here they hold only a core, and the writer thread waits on a pipe. The
    helper ends when this process closes its end of the pipe (at exit). If it cannot be started, or dies, the call
    raises and the next call starts a new one: callers are the writer's background writes, whose failures are logged
    and counted, never raised into a stage.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None

    def call(self, uri: str, method: str, args: tuple, kwargs: dict) -> Any:
        with self._lock:
            proc = self._running()
            try:
                _send(proc.stdin, (uri, method, args, kwargs))
                ok, value = _receive(proc.stdout)
            except (OSError, EOFError) as err:
                self._proc = None
                proc.kill()
                raise RuntimeError(f"the MLflow tracking process failed during {method}: {err}") from err
        if not ok:
            raise value
        return value

    def start(self) -> None:
        """Start the helper now (it imports MLflow, ~1-2 s, while the caller goes on), if it is not running."""
        with self._lock:
            self._running()

    def _running(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(_COMMAND, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        return self._proc


_HELPER = _Helper()


def prestart() -> None:
    """Start this process's helper ahead of its first record (a flow run does, when it starts)."""
    _HELPER.start()


class RemoteClient:
    """`MlflowClient(tracking_uri=uri)` whose method calls run in the helper process (`_Helper`)."""

    def __init__(self, uri: str):
        self.uri = uri

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)

        def call(*args: Any, **kwargs: Any) -> Any:
            return _HELPER.call(self.uri, method, args, kwargs)

        return call


def serve() -> None:
    """The helper's loop: (uri, method, args, kwargs) in, (ok, result or exception) out, until stdin closes."""
    requests = sys.stdin.buffer
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints go to stderr, never into the protocol

    from mlflow.tracking import MlflowClient

    clients: dict[str, MlflowClient] = {}
    while True:
        try:
            uri, method, args, kwargs = _receive(requests)
        except EOFError:
            return
        try:
            client = clients.get(uri) or clients.setdefault(uri, MlflowClient(tracking_uri=uri))
            reply = (True, getattr(client, method)(*args, **kwargs))
            data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:  # noqa: BLE001 - sent back and raised by the caller
            try:
                data = pickle.dumps((False, err), protocol=pickle.HIGHEST_PROTOCOL)
            except Exception:  # noqa: BLE001 - an exception that does not pickle
                data = pickle.dumps((False, RuntimeError(f"{type(err).__name__}: {err}")))
        _send_pickled(replies, data)
