"""What the flow tests share: a flow run in its own process (to SIGKILL it), and what a run's tasks and store show."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

KILLED_RUN = """
import sys
from flows.rlhf import rlhf_flow
from posttrain_core.config import RLHFFlowConfig
rlhf_flow(RLHFFlowConfig.model_validate_json(sys.argv[1]))
"""


def task_states(flow_run_id) -> dict[str, list[str]]:
    """Each task run's final state names, by task run name, of one flow run (the session's Prefect API)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    states: dict[str, list[str]] = {}
    for tr in runs:
        states.setdefault(tr.name, []).append(tr.state.name)
    return states


def stage_count(store, stage: str) -> int:
    return sum(1 for ref in store.list() if store.manifest(ref).get("stage") == stage)


def kill_in_iteration_2(config, log: Path, stage: str = "rl_update") -> int:
    """Run the rlhf flow on `config` in its own process on this session's Ray cluster, and SIGKILL its process
    group as iteration 2's `stage` starts building; returns the killed process's pid."""
    import ray

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
    }
    out = log.open("w")
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_RUN, config.model_dump_json()],
        cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    deadline = time.time() + 600
    try:
        # The kill comes as iteration 2's update starts building (Prefect has written the cache records of the stages
        # before it). A kill between a stage's publish and the end of its task is survived too, but the rerun then
        # shows that task as Completed (a store hit), not Cached.
        while log.read_text().count(f"{stage}: building") < 2:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.time() < deadline, "iteration 2 never started"
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return proc.pid
