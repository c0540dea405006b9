"""End-to-end: PRIME through the rlhf flow on the real Prefect API, Ray (2 workers) and MLflow, on the tiny model.

Two iterations of rollout (8 prompts, the accuracy band keeps 4) -> score -> prm_update -> process_rewards ->
rl_update. A run killed (SIGKILL of its process) while iteration 2's PRM update builds resumes there and ends on the
same policy and PRM, bit for bit, as an uninterrupted run; a rerun of a finished run builds nothing. The PRM is a
model artifact with its lineage, loadable as any model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from flow_helpers import kill_in_iteration_2, stage_count, task_states

pytestmark = pytest.mark.slow


def _config(store: Path):
    from test_rlhf_flow import _config as rlhf_config

    from posttrain_core.config import PrimeConfig, RLConfig, RolloutConfig

    rl = RLConfig(algorithm="prime", prime=PrimeConfig(lr=1e-3), oversample_factor=2, lr=1e-3, micro_batch_size=8,
                  mini_batches=2)  # fmt: skip
    rollout = RolloutConfig(n=4, max_prompts=4, max_tokens=8, num_engines=1, batch_size=8)
    return rlhf_config(store, rl=rl, rollout=rollout, eval_samples=0)


def test_prime_flow_killed_in_the_prm_update_resumes_to_the_same_policy_and_prm(
    prefect_api, ray_session, tmp_path, monkeypatch
):
    from flows.rlhf import rlhf_flow
    from posttrain_core.artifacts import ArtifactStore
    from posttrain_core.data.io import read_dataset
    from posttrain_core.models.loading import load_causal_lm

    monkeypatch.setenv("POSTTRAIN_CODE_VERSION", "test-prime-kill")  # as in test_rlhf_flow: one code version
    cfg = _config(tmp_path / "store")
    store = ArtifactStore(cfg.store)

    kill_in_iteration_2(cfg, tmp_path / "killed.log", stage="prm_update")
    assert stage_count(store, "prm_update") == 1, "the kill came too late: iteration 2's PRM update finished"

    state = rlhf_flow(cfg, return_state=True)
    result = state.result()
    states = task_states(state.state_details.flow_run_id)
    for name in ("prm_update[iter=1]", "process_rewards[iter=1]", "rl_update[iter=1]", "score[iter=2]"):
        assert states[name] == ["Cached"], (name, states)
    assert states["prm_update[iter=2]"] == ["Completed"], states

    fresh = rlhf_flow(_config(tmp_path / "fresh"))
    assert (fresh["policy"].digest, fresh["prm"].digest) == (result["policy"].digest, result["prm"].digest)
    built = {ref.key for ref in ArtifactStore(tmp_path / "fresh").list()}
    assert rlhf_flow(_config(tmp_path / "fresh"))["prm"] == fresh["prm"]  # a rerun: all cache hits
    assert {ref.key for ref in ArtifactStore(tmp_path / "fresh").list()} == built

    # The band kept 4 of the 8 prompts sampled; the update trained on the process rewards of those rows.
    policy = store.manifest(result["policy"])
    assert policy["metrics"]["band_prompts"] == 8 and policy["metrics"]["band_kept"] == 4
    assert policy["metrics"]["samples"] == 16 and "process_reward_abs_mean" in policy["metrics"]
    process = store.get(next(i["key"] for i in policy["inputs"] if i["name"] == "process"))
    rows = read_dataset(store.local_path(process), "process_rewards").to_pylist()
    assert len(rows) == 16 and all(len(r["process_rewards"]) == len(r["response_ids"]) for r in rows)
    assert any(x != 0.0 for r in rows for x in r["process_rewards"])  # PRM(2) is no longer the reference

    # The PRM: a model artifact whose lineage holds the start model and both iterations' rollouts, loadable as is.
    prm = store.manifest(result["prm"])
    assert prm["stage"] == "prm_update" and prm["objective"] == "implicit_prm"
    assert "prm_ce_loss" in prm["metrics"] and "prm_grad_norm" in prm["metrics"]
    lineage = [m.get("stage") for m in store.lineage(result["prm"])]
    assert lineage.count("prm_update") == 2 and lineage.count("score") == 2
    load_causal_lm(store.local_path(result["prm"]))
    assert {"prm_ce_loss", "process_reward_abs_mean", "band_kept"} <= set(result["curve"][0])
