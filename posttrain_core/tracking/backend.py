"""Where the MLflow records live: the tracking URI, and in-process MLflow clients on it.
A SQLite database is created and migrated once per process, under a file lock, before any client opens it."""

from __future__ import annotations

import os
from pathlib import Path

from posttrain_core.env import apply_defaults, setting


def tracking_uri(store_root: str | os.PathLike | None = None) -> str:
    """`$MLFLOW_TRACKING_URI`, else a SQLite file in the (local) store root."""
    if setting("MLFLOW_TRACKING_URI"):
        return setting("MLFLOW_TRACKING_URI")
    root = Path(store_root) if store_root and "://" not in str(store_root) else Path(".posttrain")
    root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root.resolve()}/mlflow.db"


def _unflushed_client(store_root: str | os.PathLike | None = None):
    """An MLflow client on the store's tracking URI, without waiting for the writer's pending records: for readers of
    records written synchronously, and writers that are queued behind the pending records anyway."""
    apply_defaults()
    from mlflow.tracking import MlflowClient

    uri = tracking_uri(store_root)
    _init_sqlite_once(uri)
    return MlflowClient(tracking_uri=uri)


_INITIALISED: set[str] = set()


def _init_sqlite_once(uri: str) -> None:
    """Create/migrate a SQLite tracking database under a file lock, once per process.

    Two processes opening a new database at once would both run MLflow's schema creation, and one would fail ("table
    ... already exists").
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
