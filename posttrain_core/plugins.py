"""User code referenced from a config: `"package.module:name"` or `"path/to/file.py:name"`, loaded by reference.

Reward functions, policy losses, advantage estimators, tools and environments are plugged in this way,
without editing posttrain. A reference is checked before any Ray work (a bad one fails naming the config field), its
source is part of the key of every stage that runs it (editing the code re-runs the stage; an unchanged file is a
cache hit), and Ray workers load it again by the same reference, so it must import there too.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import re
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# module path or file path, a colon, then a dotted attribute path
_REFERENCE = re.compile(r"^(?P<where>[^:]+\.py|[A-Za-z_][\w.]*):(?P<name>[A-Za-z_][\w.]*)$")


def is_reference(value: str) -> bool:
    """Whether `value` names user code (a colon between a module or .py file and a name), not a built-in."""
    return isinstance(value, str) and _REFERENCE.match(value) is not None


def absolute(ref: str) -> str:
    """The reference with a file path made absolute (Ray workers may run in another folder); modules unchanged."""
    where, name = _split(ref)
    if where.endswith(".py"):
        return f"{Path(where).expanduser().resolve()}:{name}"
    return ref


def load(ref: str, field: str = "reference") -> Any:
    """The object `ref` names.

    Raises:
        ValueError: not a reference, the file or module cannot be imported (with the import error), or it has no
            such name; the message names `field`, the config field that holds the reference.
    """
    where, name = _split(ref, field)
    try:
        module = _module(where)
    except Exception as err:  # noqa: BLE001 - any error while importing user code is the user's to see
        raise ValueError(f"{field}: cannot import {where!r} for {ref!r}: {type(err).__name__}: {err}") from err
    obj: Any = module
    for part in name.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{field}: {where!r} has no {name!r} (in {ref!r})")
        obj = getattr(obj, part)
    return obj


def source_digest(ref: str, field: str = "reference") -> str:
    """sha256 of the source that `ref` runs: its file's bytes, or its module's file (a package: its __init__)."""
    where, _ = _split(ref, field)
    if where.endswith(".py"):
        path = Path(where).expanduser()
        if not path.is_file():
            raise ValueError(f"{field}: {where!r} (in {ref!r}) is not a file")
    else:
        load(ref, field)
        file = getattr(sys.modules[where], "__file__", None)
        if file is None:
            raise ValueError(f"{field}: module {where!r} (in {ref!r}) has no source file to hash")
        path = Path(file)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _split(ref: str, field: str = "reference") -> tuple[str, str]:
    m = _REFERENCE.match(ref) if isinstance(ref, str) else None
    if m is None:
        raise ValueError(f"{field}: {ref!r} is not 'package.module:name' nor 'path/to/file.py:name'")
    return m["where"], m["name"]


def _module(where: str):
    if not where.endswith(".py"):
        return importlib.import_module(where)
    path = Path(where).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no such file {path}")
    return _file_module(str(path), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _file_module(path: str, mtime_ns: int):
    """A .py file as a module of its own (loaded again when the file changes), registered in sys.modules as
    dataclasses and pickle expect. What it defines never crosses to Ray workers: they load the reference again."""
    digest = hashlib.sha256(path.encode()).hexdigest()[:12]
    name = f"posttrain_user_{Path(path).stem}_{digest}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run_all(
    jobs: list[Callable[[], Any]], timeout_s: float, name: str = "posttrain-user-code"
) -> list[tuple[str, Any, float]]:
    """Run user code (tools, environment steps, reward functions) on a daemon thread per job, all at once, waiting at
    most `timeout_s` for them; per job ("ok", value, ms), ("error", exception, ms) or ("timeout", None, ms).

    A thread per job rather than a pool: a pool queues calls behind hung ones, and a queued call would spend its
    deadline waiting. A job past the deadline is abandoned, not killed (Python cannot kill a thread): code that may
    hang for good should do its work in a subprocess of its own. Any failure of user code is its result, never the
    caller's exception (BaseException too: a `sys.exit` in a tool must not read as a timeout).
    """
    results: list[tuple[str, Any, float]] = [("timeout", None, timeout_s * 1000)] * len(jobs)

    def work(i: int, job: Callable[[], Any]) -> None:
        started = time.perf_counter()
        try:
            value = job()
        except BaseException as err:  # noqa: BLE001 - see the docstring
            results[i] = ("error", err, round((time.perf_counter() - started) * 1000, 3))
            return
        results[i] = ("ok", value, round((time.perf_counter() - started) * 1000, 3))

    threads = [threading.Thread(target=work, args=(i, j), daemon=True, name=name) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    deadline = time.perf_counter() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.perf_counter()))
    return [("timeout", None, timeout_s * 1000) if t.is_alive() else results[i] for i, t in enumerate(threads)]
