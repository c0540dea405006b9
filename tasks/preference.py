"""Prefect tasks of the preference stages (Bradley-Terry reward model, DPO); the loops run on Ray workers."""

from __future__ import annotations

from posttrain_core.artifacts import ArtifactRef
from posttrain_core.config import DPOConfig, RewardModelConfig
from posttrain_core.stage import key_for
from posttrain_core.train.preference_stage import run_dpo, run_reward_model
from tasks.common import run_core, stage_task


def _rm_key(p, store):
    return key_for("reward_model", p["cfg"], {"data": p["data"], "base": p["base"]})


def _dpo_key(p, store):
    # The same inputs as run_dpo's stage key: the reference defaults to the policy.
    reference = p.get("reference") or p["policy"]
    return key_for("dpo", p["cfg"], {"data": p["data"], "policy": p["policy"], "reference": reference})


@stage_task("reward_model", _rm_key)
def reward_model(
    cfg: RewardModelConfig,
    data: ArtifactRef,
    base: ArtifactRef,
    store_root: str | None = None,
    parent_run_id: str | None = None,
) -> ArtifactRef:
    return run_core("reward_model", store_root, parent_run_id, lambda store: run_reward_model(cfg, data, base, store))


@stage_task("dpo", _dpo_key)
def dpo(
    cfg: DPOConfig,
    data: ArtifactRef,
    policy: ArtifactRef,
    reference: ArtifactRef | None = None,
    store_root: str | None = None,
    parent_run_id: str | None = None,
) -> ArtifactRef:
    return run_core("dpo", store_root, parent_run_id, lambda store: run_dpo(cfg, data, policy, store, reference))
