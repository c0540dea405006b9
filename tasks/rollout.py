"""Prefect tasks of the rollout and score stages (sampling on engine actors, rewards on the driver and RM actors)."""

from __future__ import annotations

from prefect import task

from posttrain_core import tracking
from posttrain_core.artifacts import ArtifactRef
from posttrain_core.config import RolloutConfig, ScoreConfig
from posttrain_core.rewards.score import STAGE as SCORE_STAGE
from posttrain_core.rewards.score import run_score, score_inputs
from posttrain_core.rollout.stage import STAGE as ROLLOUT_STAGE
from posttrain_core.rollout.stage import rollout_inputs, run_rollout
from posttrain_core.stage import key_for
from tasks.common import RETRY, is_transient, report, stage_cache, store_at


@task(
    name="rollout",
    task_run_name="rollout[iter={iteration}]",
    cache_key_fn=stage_cache(
        lambda p, store: key_for(ROLLOUT_STAGE, p["cfg"], rollout_inputs(p["prompts"], p["policy"]))
    ),
    persist_result=True,
    retry_condition_fn=is_transient,
    **RETRY,
)
def rollout(
    cfg: RolloutConfig,
    prompts: ArtifactRef,
    policy: ArtifactRef,
    iteration: int | str = 0,
    store_root: str | None = None,
    parent_run_id: str | None = None,
) -> ArtifactRef:
    store = store_at(store_root)
    with tracking.parent(parent_run_id):
        ref = run_rollout(cfg, prompts, policy, store)
    report("rollout", ref, store)
    return ref


@task(
    name="score",
    task_run_name="score[iter={iteration}]",
    cache_key_fn=stage_cache(
        lambda p, store: key_for(SCORE_STAGE, p["cfg"], score_inputs(p["rollouts"], p.get("reward_model")))
    ),
    persist_result=True,
    retry_condition_fn=is_transient,
    **RETRY,
)
def score(
    cfg: ScoreConfig,
    rollouts: ArtifactRef,
    reward_model: ArtifactRef | None = None,
    iteration: int | str = 0,
    store_root: str | None = None,
    parent_run_id: str | None = None,
) -> ArtifactRef:
    store = store_at(store_root)
    with tracking.parent(parent_run_id):
        ref = run_score(cfg, rollouts, store, reward_model=reward_model)
    report("score", ref, store)
    return ref
