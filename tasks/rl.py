"""Prefect tasks of the RL stages: the policy (and critic) update, and VAPO's value pretraining."""

from __future__ import annotations

from posttrain_core import tracking
from posttrain_core.artifacts import ArtifactRef
from posttrain_core.config import RLConfig
from posttrain_core.stage import key_for
from posttrain_core.train.rl_stage import (
    STAGE,
    VALUE_STAGE,
    NextRollout,
    run_rl_update,
    run_value_pretrain,
    update_inputs,
)
from tasks.common import report, stage_task, store_at


def _update_key(p, store):
    return key_for(STAGE, p["cfg"], update_inputs(p["scored"], p["policy"], p["reference"], p.get("critic")))


@stage_task("rl_update", _update_key, run_name="update[iter={iteration}]")
def rl_update(
    cfg: RLConfig,
    scored: list[ArtifactRef],
    policy: ArtifactRef,
    reference: ArtifactRef,
    critic: ArtifactRef | None = None,
    iteration: int = 0,
    store_root: str | None = None,
    parent_run_id: str | None = None,
    next_rollout: NextRollout | None = None,
) -> ArtifactRef:
    """`next_rollout`: the rollout stage that follows on a warm engine pool, started early (`run_rl_update`); not
    part of the cache key, since the artifact is the same without it."""
    store = store_at(store_root)
    with tracking.parent(parent_run_id):
        ref = run_rl_update(cfg, scored, policy, reference, store, critic=critic, next_rollout=next_rollout)
    report(f"rl_update.iter{iteration}", ref, store)
    return ref


@stage_task(
    "value_pretrain",
    lambda p, store: key_for(VALUE_STAGE, p["cfg"], {"scored": p["scored"], "policy": p["policy"]}),
)
def value_pretrain(
    cfg: RLConfig,
    scored: ArtifactRef,
    policy: ArtifactRef,
    store_root: str | None = None,
    parent_run_id: str | None = None,
) -> ArtifactRef:
    store = store_at(store_root)
    with tracking.parent(parent_run_id):
        ref = run_value_pretrain(cfg, scored, policy, store)
    report("value_pretrain", ref, store)
    return ref
