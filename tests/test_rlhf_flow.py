"""End-to-end: the rlhf flow on the real Prefect API, Ray (2 workers) and MLflow, on a tiny model.

A run killed (SIGKILL of the whole process) during iteration 2 and started again reuses every stage published before
the kill and ends with the same final policy, bit for bit, as an uninterrupted run with the same seeds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def _config(store: Path, **overrides):
    from posttrain_core.config import (
        DataConfig,
        EvalConfig,
        ModelConfig,
        RLConfig,
        RLHFFlowConfig,
        RolloutConfig,
        ScoreConfig,
    )

    # The untrained tiny model rarely writes a digit: "contains a digit" is a reward with variance within groups.
    fields = dict(
        store=str(store),
        data=DataConfig(n_train=200, n_eval=16),
        model=ModelConfig(size="tiny"),
        pretrain=None,
        sft=None,
        iterations=2,
        rollout=RolloutConfig(n=4, max_prompts=8, max_tokens=8, num_engines=1, batch_size=8),
        score=ScoreConfig(verifiers={"regex": 1.0, "exact_match": 0.0}, regex="[0-9]"),  # exact_match: `correct` only
        rl=RLConfig(algorithm="grpo", lr=1e-3, micro_batch_size=8, mini_batches=2),
        eval=EvalConfig(max_new_tokens=4, num_engines=1),
        eval_samples=2,
    )
    return RLHFFlowConfig(**{**fields, **overrides})


def _task_states(flow_run_id) -> dict[str, list[str]]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    states: dict[str, list[str]] = {}
    for tr in runs:
        states.setdefault(tr.name, []).append(tr.state.name)
    return states


KILLED_RUN = """
import sys
from flows.rlhf import rlhf_flow
from posttrain_core.config import RLHFFlowConfig
rlhf_flow(RLHFFlowConfig.model_validate_json(sys.argv[1]))
"""


def _stage_count(store, stage: str) -> int:
    return sum(1 for ref in store.list() if store.manifest(ref).get("stage") == stage)


def test_rlhf_flow_killed_in_iteration_2_resumes_there(prefect_api, ray_session, tmp_path, monkeypatch):
    from flows.rlhf import rlhf_flow
    from posttrain_core.artifacts import ArtifactStore

    # The killed run's process hashes posttrain_core into every stage key when it starts, this one did at its first
    # key: an edit to the code in between (during a long session) would make every stage of the rerun new.
    monkeypatch.setenv("POSTTRAIN_CODE_VERSION", "test-rlhf-kill")
    cfg = _config(tmp_path / "store")
    store = ArtifactStore(cfg.store)

    # 1. Run in its own process; SIGKILL the process group once iteration 2's update has started building.
    import ray

    # The run joins this session's Ray cluster (a flow process on a shared cluster; also no second raylet to start).
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
    }
    log = (tmp_path / "killed.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_RUN, cfg.model_dump_json()],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    deadline = time.time() + 600
    try:
        # The kill comes as iteration 2's update starts building (Prefect has written the cache records of the stages
        # before it). A kill between a stage's publish and the end of its task is survived too, but the rerun then
        # shows that task as Completed (a store hit), not Cached.
        while (tmp_path / "killed.log").read_text().count("rl_update: building") < 2:
            assert proc.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
            assert time.time() < deadline, "iteration 2 never started"
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert _stage_count(store, "rl_update") == 1, "the kill came too late: iteration 2's update finished"
    published = {ref.key for ref in store.list()}

    # 2. Start it again: everything published before the kill is a cache hit; iteration 2's update runs.
    state = rlhf_flow(cfg, return_state=True)
    result = state.result()
    states = _task_states(state.state_details.flow_run_id)
    for name in ("rollout[iter=1]", "score[iter=1]", "rl_update[iter=1]", "rollout[iter=2]", "score[iter=2]"):
        assert states[name] == ["Cached"], (name, states)
    assert states["rl_update[iter=2]"] == ["Completed"], states
    assert published <= {ref.key for ref in store.list()}
    # The killed process could not end the runs it had open: the flow's, and those of iteration 2's stages whose
    # records its background writer had not written yet (the update's, and the score's closing record if it was
    # still queued). The rerun marked them KILLED; nothing is left RUNNING. The rerun's own run: FINISHED.
    from posttrain_core import tracking

    c = tracking.client(cfg.store)
    exps = [e.experiment_id for e in c.search_experiments()]
    runs = c.search_runs(exps, filter_string=f"tags.`posttrain.pid` = '{proc.pid}'")
    ended = sorted((r.info.run_name.split("/")[0], r.info.status) for r in runs if r.info.status != "FINISHED")
    assert ("rlhf", "KILLED") in ended and {status for _, status in ended} == {"KILLED"}, ended
    assert {name for name, _ in ended} <= {"rlhf", "score", "rl_update"}, ended
    assert c.get_run(result["mlflow_run_id"]).info.status == "FINISHED"
    assert _stage_count(store, "rl_update") == 2 and _stage_count(store, "rollout") == 2
    assert _stage_count(store, "evaluate") == 4  # greedy and sampled, before and after
    before = result["eval"][0]
    assert 0 <= before["sampled_pass@1"] <= before["sampled_pass@2"] <= 1 and "accuracy" in before

    # 3. The same final policy as an uninterrupted run with the same seeds, in a fresh store. In both, iteration 2's
    # rollout was generated with update 1's weights in memory before they were published.
    fresh = rlhf_flow(_config(tmp_path / "fresh"))
    assert fresh["policy"].digest == result["policy"].digest
    assert fresh["curve"] == result["curve"]
    loads = {
        name: {m.get("engine_load") for m in map(s.manifest, s.list()) if m.get("stage") == "rollout"}
        for name, s in (("resumed", store), ("fresh", ArtifactStore(tmp_path / "fresh")))
    }
    assert "prefetched" in loads["resumed"] and "prefetched" in loads["fresh"], loads

    # What an iteration records: every metric docs/algorithms.md lists, the lineage, the curve picture.
    metrics = store.manifest(result["policy"])["metrics"]
    for name in (
        "reward_mean", "reward_std", "accuracy", "response_len_mean", "response_len_max", "kl_k1", "kl_k3",
        "entropy", "clip_frac", "approx_kl", "grad_norm", "logp_mismatch_mean",
    ):  # fmt: skip
        assert name in metrics, (name, sorted(metrics))
    assert metrics["logp_mismatch_mean"] < 1e-3, metrics  # hf engine log-probs = the trainer's
    assert metrics["reward_std"] > 0
    lineage = [m.get("stage") for m in store.lineage(result["policy"])]
    assert lineage.count("rl_update") == 2 and "rollout" in lineage and "score" in lineage
    assert Path(result["curve_png"]).read_bytes()[:4] == b"\x89PNG"
    assert [r["iteration"] for r in result["curve"]] == [1, 2]


def test_dynamic_sampling_gives_up_when_every_group_is_uniform(prefect_api, ray_session, tmp_path):
    from flows.rlhf import rlhf_flow
    from posttrain_core.config import RLConfig, ScoreConfig
    from posttrain_core.train.rl_plan import DynamicSamplingError

    # An untrained model never answers arithmetic right: every group is all-wrong (reward 0 everywhere).
    cfg = _config(
        tmp_path / "store",
        iterations=1,
        score=ScoreConfig(verifiers={"exact_match": 1.0}),
        rl=RLConfig(algorithm="grpo", dynamic_sampling=True, max_gen_batches=2, micro_batch_size=8),
    )
    with pytest.raises(DynamicSamplingError, match=r"only 0 of the 8 wanted prompts.*max_gen_batches=2"):
        rlhf_flow(cfg)
    from posttrain_core.artifacts import ArtifactStore

    store = ArtifactStore(cfg.store)
    assert _stage_count(store, "rollout") == 2 and _stage_count(store, "rl_update") == 0  # 2 generation batches
