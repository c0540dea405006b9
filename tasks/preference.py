"""Prefect tasks of the preference stages (Bradley-Terry reward model, DPO); the loops run on Ray workers."""

from __future__ import annotations

from prefect import task

from posttrain_core import tracking
from posttrain_core.artifacts import ArtifactRef
from posttrain_core.config import DPOConfig, RewardModelConfig
from posttrain_core.stage import key_for
from posttrain_core.train.preference import run_dpo, run_reward_model
from tasks.common import RETRY, is_transient, report, stage_cache, store_at


def _rm_key(p, store):
    return key_for("reward_model", p["cfg"], {"data": p["data"], "base": p["base"]})


def _dpo_key(p, store):
    # The same inputs as run_dpo's stage key: the reference defaults to the policy.
    reference = p.get("reference") or p["policy"]
    return key_for("dpo", p["cfg"], {"data": p["data"], "policy": p["policy"], "reference": reference})


@task(
    name="reward_model",
    task_run_name="reward_model",
    cache_key_fn=stage_cache(_rm_key),
    persist_result=True,
    retry_condition_fn=is_transient,
    **RETRY,
)
def reward_model(
    cfg: RewardModelConfig,
    data: ArtifactRef,
    base: ArtifactRef,
    store_root: str | None = None,
    parent_run_id: str | None = None,
) -> ArtifactRef:
    store = store_at(store_root)
    with tracking.parent(parent_run_id):
        ref = run_reward_model(cfg, data, base, store)
    report("reward_model", ref, store)
    return ref


@task(
    name="dpo",
    task_run_name="dpo",
    cache_key_fn=stage_cache(_dpo_key),
    persist_result=True,
    retry_condition_fn=is_transient,
    **RETRY,
)
def dpo(
    cfg: DPOConfig,
    data: ArtifactRef,
    policy: ArtifactRef,
    reference: ArtifactRef | None = None,
    store_root: str | None = None,
    parent_run_id: str | None = None,
) -> ArtifactRef:
    store = store_at(store_root)
    with tracking.parent(parent_run_id):
        ref = run_dpo(cfg, data, policy, store, reference=reference)
    report("dpo", ref, store)
    return ref
