"""`prefect deployment run` against a real `prefect server` and a process worker, using deployments/prefect.yaml."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout}s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:  # the worker has been seen ignoring SIGTERM for ~20 s
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_deploy_and_run_from_the_cli(tmp_path, tiny_config):
    from posttrain_core.artifacts import ArtifactStore
    from posttrain_core.cluster import free_port

    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_API_URL": api,
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PWD": str(REPO),  # the pull step's working directory
    }
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(
        [BIN / "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    worker = None
    try:
        _wait_healthy(f"{api}/health", server)

        def cli(*args: str, timeout: float = 120) -> str:
            r = subprocess.run(
                [BIN / "prefect", *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout
            )
            assert r.returncode == 0, f"prefect {' '.join(args)}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
            return r.stdout + r.stderr

        cli("work-pool", "create", "posttrain-local", "--type", "process")
        cli("--no-prompt", "deploy", "--all", "--prefect-file", "deployments/prefect.yaml")

        with urllib.request.urlopen(f"{api}/deployments/name/sft/nightly") as r:
            nightly = json.load(r)
        assert nightly["schedules"][0]["schedule"]["cron"] == "0 3 * * *"
        assert nightly["parameters"]["config"]["experiment"] == "posttrain-nightly"

        worker = subprocess.Popen(
            [BIN / "prefect", "worker", "start", "--pool", "posttrain-local", "--limit", "1"],
            env=env,
            cwd=REPO,
            stdout=(tmp_path / "worker.log").open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        store = tmp_path / "store"
        params = {"config": tiny_config.model_copy(update={"store": str(store)}).model_dump(mode="json")}
        out = cli(
            "deployment",
            "run",
            "sft/demo",
            "--params",
            json.dumps(params),
            "--watch",
            "--watch-timeout",
            "480",
            timeout=540,
        )
        assert "Completed" in out, out[-2000:] + (tmp_path / "worker.log").read_text()[-4000:]

        stages = {ArtifactStore(store).manifest(r).get("stage") for r in ArtifactStore(store).list()}
        assert {"sft", "pretrain", "evaluate", "build_model"} <= stages
    finally:
        if worker is not None:
            _stop(worker)
        _stop(server)
