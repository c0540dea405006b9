"""Concurrent flow runs on one store: identical stages are built once (the other run waits, then reuses the
artifact), different stages do not interfere, and both runs succeed.

Two real processes run the SFT flow at the same time against one Prefect API server, the session's Ray cluster and
one MLflow store; they share every stage but SFT and its evaluation.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]

RUN = """
import sys
from flows.sft import sft_flow
from posttrain_core.config import SFTFlowConfig
result = sft_flow(SFTFlowConfig.model_validate_json(sys.argv[1]))
print("MODEL", result["model"].key)
"""


def test_two_flows_at_once_build_shared_stages_once(prefect_api, ray_session, tiny_config, tmp_path):
    import ray
    from prefect.settings import PREFECT_API_URL

    from posttrain_core import tracking
    from posttrain_core.artifacts import ArtifactStore
    from posttrain_core.config import EvalConfig

    store = ArtifactStore(tmp_path / "shared-store")
    base = tiny_config.model_copy(
        update={
            "store": str(store.root),
            "pretrain": None,  # one shared training stage less: SFT's base is the tiny model itself
            # What is tested is the sharing, not SFT: one rank per run (two runs' ranks starting at once on 2 cores
            # take ~20 s more than one run's).
            "sft": tiny_config.sft.model_copy(update={"max_steps": 8, "num_workers": 1}),
            "eval": EvalConfig(max_new_tokens=4, max_prompts=8, num_engines=1),
        }
    )
    configs = [base, base.model_copy(update={"sft": base.sft.model_copy(update={"lr": 2e-3})})]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
        "PREFECT_API_URL": PREFECT_API_URL.value(),  # both runs report to this session's API server
    }
    results: list[subprocess.CompletedProcess | None] = [None, None]

    def run(i: int) -> None:
        results[i] = subprocess.run(
            [sys.executable, "-c", RUN, configs[i].model_dump_json()],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
        )  # fmt: skip

    since_ms = int(time.time() * 1000)  # the session shares one MLflow database: earlier tests built these keys too
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        assert r is not None and r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:]) if r else "no result"
    models = [next(line.split()[1] for line in r.stdout.splitlines() if line.startswith("MODEL")) for r in results]
    assert models[0] != models[1]  # different SFT configs: two models

    # One artifact per key, no publish left half-done.
    stages = Counter(store.manifest(ref)["stage"] for ref in store.list())
    assert stages.pop("sft") == 2 and stages.pop("evaluate") == 3, stages  # two SFTs; base + two SFT models
    assert set(stages.values()) == {1}, stages  # data and base model: shared
    leftovers = [p for p in (Path(store.root) / "artifacts").glob("*/*") if not (p / "manifest.json").exists()]
    assert leftovers == []

    # Built once: exactly one MLflow stage run per artifact key, and it FINISHED (the waiting run built nothing).
    c = tracking.client(store.root)
    ours = {ref.key for ref in store.list()}
    runs = [
        r
        for r in c.search_runs([e.experiment_id for e in c.search_experiments()], max_results=10_000)
        if r.data.tags.get("posttrain.key") in ours and r.info.start_time >= since_ms
    ]
    built = Counter(r.data.tags["posttrain.key"] for r in runs)
    assert max(built.values()) == 1, f"a stage was built twice: {built}"
    assert len(built) == 6, built  # model, 2 SFTs, 3 evals (data preparation: one run for its 5 datasets)
    assert {r.info.status for r in runs} == {"FINISHED"}
