"""Prefect tasks of the rollout and score stages (sampling on engine actors, rewards on the driver and RM actors)."""

from __future__ import annotations

from posttrain_core import tracking
from posttrain_core.artifacts import ArtifactRef
from posttrain_core.config import RolloutConfig, ScoreConfig
from posttrain_core.rewards.score import STAGE as SCORE_STAGE
from posttrain_core.rewards.score import run_score, score_inputs
from posttrain_core.rollout.stage import STAGE as ROLLOUT_STAGE
from posttrain_core.rollout.stage import rollout_inputs, run_rollout
from posttrain_core.stage import key_for
from tasks.common import report, stage_task, store_at


@stage_task(
    "rollout",
    lambda p, store: key_for(ROLLOUT_STAGE, p["cfg"], rollout_inputs(p["prompts"], p["policy"])),
    run_name="rollout[iter={iteration}]",
)
def rollout(
    cfg: RolloutConfig,
    prompts: ArtifactRef,
    policy: ArtifactRef,
    iteration: int | str = 0,
    store_root: str | None = None,
    parent_run_id: str | None = None,
    engines: str | None = None,
) -> ArtifactRef:
    """`engines`: a warm engine pool of this flow run (`posttrain_core.rollout.warm`); not part of the cache key,
    since it changes how the engines get the weights, not the samples."""
    store = store_at(store_root)
    with tracking.parent(parent_run_id):
        ref = run_rollout(cfg, prompts, policy, store, engines=engines)
    report("rollout", ref, store)
    return ref


@stage_task(
    "score",
    lambda p, store: key_for(SCORE_STAGE, p["cfg"], score_inputs(p["rollouts"], p.get("reward_model"))),
    run_name="score[iter={iteration}]",
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
