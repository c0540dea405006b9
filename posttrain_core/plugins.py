"""User code referenced from a config: `"package.module:name"` or `"path/to/file.py:name"`, loaded by reference.

Reward functions, policy losses, advantage estimators (and later tools and environments) are plugged in this way,
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
