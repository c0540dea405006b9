"""Shared fixtures: one real Prefect ephemeral API, one local Ray session and one MLflow SQLite store per test session."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

_SESSION_DIR = Path(tempfile.mkdtemp(prefix="posttrain-tests-"))
os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{_SESSION_DIR}/mlflow.db")
os.environ.setdefault("PREFECT_RESULTS_LOCAL_STORAGE_PATH", str(_SESSION_DIR / "prefect-results"))
os.environ.setdefault("PREFECT_HOME", str(_SESSION_DIR / "prefect-home"))

from posttrain_core.env import apply_defaults  # noqa: E402

apply_defaults()


@pytest.fixture(scope="session")
def session_dir() -> Path:
    return _SESSION_DIR


@pytest.fixture(scope="session")
def prefect_api():
    """A real Prefect API (temporary SQLite database) for the whole session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        yield


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray instance shared by the tests that launch Ray work."""
    import ray

    from posttrain_core.cluster import connect

    connect()
    yield
    ray.shutdown()


@pytest.fixture
def store(tmp_path):
    from posttrain_core.artifacts import ArtifactStore

    return ArtifactStore(tmp_path / "store")
