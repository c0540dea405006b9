"""End-to-end: off-policy RL with a bounded lag (`rl.rollout_lag = 1`, `off_policy = "tis"`) through the rlhf flow
on the real Prefect API, Ray (2 workers) and MLflow, on the tiny model.

Rollout k+1 samples with policy k-1 and is submitted before update k waits: the first two rollouts sample from the
start policy, the third from update 1's. A run killed (SIGKILL of its process) while iteration 2's update trains
beside rollout 3 resumes to the same final policy, bit for bit, as an uninterrupted run; each update records the
staleness and the importance weights of its rows; `max_staleness = 0` refuses the lagged rows, naming them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from flow_helpers import kill_in_iteration_2

pytestmark = pytest.mark.slow


def _config(store: Path, iterations: int = 3, **rl):
    from test_rlhf_flow import _config as rlhf_config

    from posttrain_core.config import RLConfig

    rl = RLConfig(lr=1e-3, micro_batch_size=8, mini_batches=2, rollout_lag=1, off_policy="tis", **rl)
    # eval_every=2: iteration 2's evaluation and rollout 3 want the engines at once (they take turns, `WarmGroup.busy`)
    return rlhf_config(store, rl=rl, iterations=iterations, eval_samples=0, eval_every=2)


def test_a_lagged_run_samples_from_the_older_policy_resumes_bit_for_bit_and_bounds_staleness(
    prefect_api, ray_session, tmp_path, monkeypatch
):
    from flows.rlhf import rlhf_flow
    from posttrain_core.artifacts import ArtifactStore

    monkeypatch.setenv("POSTTRAIN_CODE_VERSION", "test-lag")  # as in test_rlhf_flow: one code version
    cfg = _config(tmp_path / "store")
    store = ArtifactStore(cfg.store)

    kill_in_iteration_2(cfg, tmp_path / "killed.log", stage="rl_update")
    resumed = rlhf_flow(cfg)
    fresh = rlhf_flow(_config(tmp_path / "fresh"))
    assert resumed["policy"].digest == fresh["policy"].digest

    # The schedule: rollouts 1 and 2 sampled by the start policy, rollout 3 by update 1's.
    policies = [p.uri for p in resumed["policies"]]
    by = {}
    for ref in store.list():
        m = store.manifest(ref)
        if m.get("stage") == "rollout":
            by.setdefault(m["policy"], []).append(ref)
    assert len(by[policies[0]]) == 2 and len(by[policies[1]]) == 1 and policies[2] not in by
    # Each update: its staleness in policy versions, the importance weights of its rows, the waits.
    metrics = [store.manifest(p)["metrics"] for p in resumed["policies"][1:]]
    assert [m["staleness_max"] for m in metrics] == [0.0, 1.0, 1.0]
    assert [store.manifest(p)["version"] for p in resumed["policies"][1:]] == [1, 2, 3]
    # Update 1's rows are on-policy (the start sampled them and is being updated): with the fp32 hf engine every
    # weight is 1 within the log-prob tolerance, so tis changes nothing there.
    assert abs(metrics[0]["is_weight_min"] - 1) < 1e-3 and abs(metrics[0]["is_weight_max"] - 1) < 1e-3
    for m in metrics[1:]:
        assert 0.0 < m["is_ess"] <= 1.0 and m["is_weight_min"] <= m["is_weight_mean"] <= m["is_weight_max"]
    assert metrics[1]["is_weight_max"] != pytest.approx(1.0)  # update 1 moved the policy: the rows are off-policy
    assert all("update_wait_s" in row and "rollout_wait_s" in row for row in resumed["curve"])

    # max_staleness = 0: update 2 refuses the rows rollout 2 sampled with the start policy (a version behind).
    with pytest.raises(ValueError, match=r"policy version 0 .* 1 update\(s\) behind .* rl.max_staleness=0 refuses"):
        rlhf_flow(_config(tmp_path / "fresh", iterations=2, max_staleness=0))
