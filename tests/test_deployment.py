"""deployments/prefect.yaml against a real `prefect server` and a process worker, driven by the Prefect CLI.

One server, work pool and worker for the module: every deployment registers with a paused cron schedule and a
parameter form; a wrong-type parameter is refused before a run exists; a `sft/demo` run cancelled with
`prefect flow-run cancel` ends Cancelled (MLflow KILLED, nothing partial published), and a rerun resumes its SFT stage
from the in-stage checkpoint without redoing the published stages and runs to completion with its MLflow run.
"""

from __future__ import annotations

import json
import os
import re
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
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
DEPLOYMENTS = {
    "sft/demo", "preference/rm-demo", "rlhf/grpo-demo", "rlhf/ppo-demo", "rlhf/opd-demo", "eval/latest", "serve/tinker"
}  # fmt: skip


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
            proc.wait(timeout=3)
        except subprocess.TimeoutExpired:  # the worker has been seen ignoring SIGTERM for ~20 s; it runs nothing now
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


class Server:
    """A Prefect server + process worker on loopback, and helpers for its CLI and REST API."""

    def __init__(self, tmp: Path):
        from posttrain_core.cluster import free_port

        self.tmp, self.port = tmp, free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.env = {
            **os.environ,
            "PREFECT_API_URL": self.api,
            "PREFECT_HOME": str(tmp / "prefect-home"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "PWD": str(REPO),  # the pull step's working directory
            # Each flow run is a new process that hashes posttrain_core into every stage key: an edit to the code
            # between the cancelled run and its rerun would make the rerun rebuild everything instead of resuming.
            "POSTTRAIN_CODE_VERSION": "test-deployment",
        }
        self.procs: list[subprocess.Popen] = []

    def spawn(self, name: str, *args: str) -> subprocess.Popen:
        proc = subprocess.Popen(
            [BIN / "prefect", *args],
            env=self.env,
            cwd=REPO,
            stdout=(self.tmp / f"{name}.log").open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def cli(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run(
            [BIN / "prefect", *args], env=self.env, cwd=REPO, capture_output=True, text=True, timeout=timeout
        )
        if check:
            assert r.returncode == 0, (
                f"prefect {' '.join(args)}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}\n{self.logs()}"
            )
        return r

    def get(self, path: str):
        with urllib.request.urlopen(f"{self.api}{path}") as r:
            return json.load(r)

    def post(self, path: str, body: dict):
        req = urllib.request.Request(
            f"{self.api}{path}", json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req) as r:
            return json.load(r)

    def logs(self) -> str:
        return (self.tmp / "worker.log").read_text()[-4000:] if (self.tmp / "worker.log").exists() else ""

    def run(self, deployment: str, params: dict, watch: bool = True) -> str:
        """`prefect deployment run`; returns the flow run id (after completion when watching)."""
        args = ["deployment", "run", deployment, "--params", json.dumps(params)]
        if watch:
            args += ["--watch", "--watch-timeout", "480"]
        r = self.cli(*args, timeout=540)
        out = r.stdout + r.stderr
        if watch:
            assert "Completed" in out, out[-2000:] + self.logs()
        return UUID.search(out.split("UUID", 1)[-1]).group(0)

    def wait_state(self, flow_run_id: str, types: set[str], timeout: float = 180) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            state = self.get(f"/flow_runs/{flow_run_id}")["state"]["type"]
            if state in types:
                return state
            time.sleep(0.5)
        raise TimeoutError(f"flow run {flow_run_id} still {state} after {timeout}s\n{self.logs()}")


@pytest.fixture(scope="module")
def server(tmp_path_factory, ray_session):
    import ray

    srv = Server(tmp_path_factory.mktemp("prefect-server"))
    # The flow runs join this session's Ray cluster (flow processes on a shared cluster): no local Ray to start in
    # each run's process, nor to stop when the run is cancelled.
    srv.env["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    try:
        proc = srv.spawn("server", "server", "start", "--host", "127.0.0.1", "--port", str(srv.port))
        _wait_healthy(f"{srv.api}/health", proc)
        srv.cli("work-pool", "create", "posttrain-local", "--type", "process")
        srv.cli("--no-prompt", "deploy", "--all", "--prefect-file", "deployments/prefect.yaml")
        srv.spawn("worker", "worker", "start", "--pool", "posttrain-local", "--limit", "1")
        yield srv
    finally:
        for proc in reversed(srv.procs):
            _stop(proc)


def _mlflow_run(flow_run_id: str):
    from posttrain_core import tracking

    c = tracking.client()
    runs = c.search_runs(
        [e.experiment_id for e in c.search_experiments()], f"tags.`prefect.flow_run_id` = '{flow_run_id}'"
    )
    assert len(runs) == 1, f"{len(runs)} MLflow runs for flow run {flow_run_id}"
    return runs[0]


def test_deployments_register_with_paused_schedules_and_a_parameter_form(server):
    deployments = server.post("/deployments/filter", {})
    flows = {f["id"]: f["name"] for f in server.post("/flows/filter", {})}
    by_name = {f"{flows[d['flow_id']]}/{d['name']}": d for d in deployments}
    assert set(by_name) == DEPLOYMENTS
    for name, d in by_name.items():
        assert d["work_pool_name"] == "posttrain-local", name
        assert d["schedules"] and all(not s["active"] and s["schedule"]["cron"] for s in d["schedules"]), name
        assert "config" in d["parameter_openapi_schema"]["properties"], name  # the UI's form
    assert by_name["preference/rm-demo"]["parameters"]["config"]["dpo"] is None
    assert by_name["rlhf/ppo-demo"]["parameters"]["config"]["rl"]["algorithm"] == "ppo"
    from posttrain_core.config import RLHFFlowConfig

    opd = RLHFFlowConfig.model_validate(by_name["rlhf/opd-demo"]["parameters"]["config"])  # a config the flow takes
    assert opd.rl.algorithm == "opd" and opd.rl.distill.teacher == "latest:rl_update"
    assert by_name["eval/latest"]["parameters"]["config"]["models"] == ["latest:sft", "latest:rl_update"]
    assert by_name["serve/tinker"]["parameters"]["config"]["base_models"] == {"posttrain/sft": "latest:sft"}


def test_a_wrong_type_parameter_is_refused_naming_the_field(server):
    before = len(server.post("/flow_runs/filter", {}))
    r = server.cli(
        "deployment", "run", "sft/demo", "--params", '{"config": {"sft": {"max_steps": "many"}}}', check=False
    )
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "max_steps" in out and "many" in out, out[-2000:]
    assert len(server.post("/flow_runs/filter", {})) == before  # refused before a run was created


def test_a_run_cancelled_from_the_cli_resumes_and_completes_when_run_again(server, tiny_config, tmp_path):
    from posttrain_core.artifacts import ArtifactStore

    store = ArtifactStore(tmp_path / "deployment-store")
    # Enough SFT steps after the first checkpoint (step 5) that the cancel lands while SFT still trains.
    long_sft = tiny_config.sft.model_copy(update={"max_steps": 150, "checkpoint_every": 5})
    # No pretraining: SFT's base is the built model, and the stages before SFT are data and model (one training
    # stage less to wait for).
    config = tiny_config.model_copy(update={"store": str(store.root), "sft": long_sft, "pretrain": None})
    params = {"config": config.model_dump(mode="json")}

    flow_run_id = server.run("sft/demo", params, watch=False)
    checkpoints = store.staging_root.glob("*/checkpoints/step_*.pt")
    deadline = time.time() + 300
    while not any(True for _ in checkpoints):
        assert time.time() < deadline, "no in-stage checkpoint within 300 s\n" + server.logs()
        assert server.get(f"/flow_runs/{flow_run_id}")["state"]["type"] in {"SCHEDULED", "PENDING", "RUNNING"}
        time.sleep(0.5)
        checkpoints = store.staging_root.glob("*/checkpoints/step_*.pt")
    server.cli("flow-run", "cancel", flow_run_id)
    assert server.wait_state(flow_run_id, {"CANCELLED", "COMPLETED", "FAILED", "CRASHED"}) == "CANCELLED"
    # The stages before SFT were published; nothing partial was: SFT (and the evaluations after it) never completed.
    published = {r.key: store.manifest(r)["created"] for r in store.list()}
    stages = {store.manifest(k)["stage"] for k in published}
    assert {"prepare_data.sft", "build_model"} <= stages and not stages & {"sft", "evaluate"}, stages

    rerun = server.run("sft/demo", params)
    sft = [r for r in store.list() if r.key not in published and store.manifest(r)["stage"] == "sft"]
    assert len(sft) == 1 and store.manifest(sft[0])["resumed_from_step"] >= 5  # resumed, not restarted
    # RAY_ADDRESS: the run's workers ran on the session's cluster (its GCS port; Ray reports the node's own IP), not
    # on a local Ray of the run's process.
    import ray

    gcs_port = ray.get_runtime_context().gcs_address.rsplit(":", 1)[1]
    assert store.manifest(sft[0])["ray_address"].rsplit(":", 1)[1] == gcs_port, store.manifest(sft[0])["ray_address"]
    assert {k: store.manifest(k)["created"] for k in published} == published  # published stages were not redone
    assert "evaluate" in {store.manifest(r)["stage"] for r in store.list()}
    # The cancelled run's MLflow run ended KILLED (by Prefect's termination signal, or by the rerun's orphan sweep).
    assert _mlflow_run(flow_run_id).info.status == "KILLED"
    run = _mlflow_run(rerun)
    assert run.info.status == "FINISHED" and run.info.run_name.startswith("sft/")
    assert run.data.tags["prefect.flow_run_url"].endswith(f"/runs/flow-run/{rerun}")
    links = server.post("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [rerun]}}})
    link = next(a for a in links if a["key"] == "mlflow-run")
    assert f"/runs/{run.info.run_id}" in link["data"]  # the Prefect UI's link to the MLflow run
    # Every stage's result table, posted in the background after its task returned, is attached to that task run:
    # SFT's in the rerun, the SFT dataset's in the cancelled run (a cache hit in the rerun).
    cancelled = server.post("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}})
    tables = {a["key"]: a for a in links + cancelled if a["key"].endswith("-result")}
    data = "prepare-data-sft-result"
    assert {"sft-result", data} <= set(tables), sorted(tables)
    assert tables["sft-result"]["flow_run_id"] == rerun and tables[data]["flow_run_id"] == flow_run_id
    for name in ("sft-result", data):
        assert tables[name]["task_run_id"] and "mlflow_run_id" in tables[name]["data"], name
