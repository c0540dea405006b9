"""Prefect tasks of the rollout and score stages (sampling on engine actors, rewards on the driver and RM actors)."""

from __future__ import annotations

from posttrain_core.artifacts import ArtifactRef
from posttrain_core.config import DistillConfig, RolloutConfig, ScoreConfig
from posttrain_core.rewards.score import STAGE as SCORE_STAGE
from posttrain_core.rewards.score import run_score, score_inputs
from posttrain_core.rollout.stage import STAGE as ROLLOUT_STAGE
from posttrain_core.rollout.stage import rollout_inputs, run_rollout
from posttrain_core.rollout.teacher import STAGE as TEACHER_STAGE
from posttrain_core.rollout.teacher import run_teacher_logprobs, teacher_inputs
from posttrain_core.stage import key_for
from posttrain_core.warm import WarmGroup
from tasks.common import run_core, stage_task


@stage_task(
    ROLLOUT_STAGE,
    lambda p, store: key_for(ROLLOUT_STAGE, p["cfg"], rollout_inputs(p["prompts"], p["policy"])),
    run_name="rollout[iter={iteration}]",
)
def rollout(
    cfg: RolloutConfig,
    prompts: ArtifactRef,
    policy: ArtifactRef,
    iteration: int = 0,
    store_root: str | None = None,
    parent_run_id: str | None = None,
    warm: WarmGroup | None = None,
) -> ArtifactRef:
    """`warm`: the warm group whose engines generate; not part of the cache key, since it changes how
    the engines get the weights, not the samples."""
    return run_core(
        f"rollout[iter={iteration}]", store_root, parent_run_id,
        lambda store: run_rollout(cfg, prompts, policy, store, warm),
    )  # fmt: skip


@stage_task(
    SCORE_STAGE,
    lambda p, store: key_for(SCORE_STAGE, p["cfg"], score_inputs(p["rollouts"], p.get("reward_model"))),
    run_name="score[iter={iteration}]",
)
def score(
    cfg: ScoreConfig,
    rollouts: ArtifactRef,
    reward_model: ArtifactRef | None = None,
    iteration: int = 0,
    store_root: str | None = None,
    parent_run_id: str | None = None,
) -> ArtifactRef:
    return run_core(
        f"score[iter={iteration}]", store_root, parent_run_id,
        lambda store: run_score(cfg, rollouts, store, reward_model=reward_model),
    )  # fmt: skip


@stage_task(
    TEACHER_STAGE,
    lambda p, store: key_for(TEACHER_STAGE, p["cfg"].scoring(), teacher_inputs(p["rollouts"], p["teacher"])),
    run_name="teacher_logprobs[iter={iteration}]",
)
def teacher_logprobs(
    cfg: DistillConfig,
    rollouts: ArtifactRef,
    teacher: ArtifactRef,
    iteration: int = 0,
    store_root: str | None = None,
    parent_run_id: str | None = None,
    warm: WarmGroup | None = None,
) -> ArtifactRef:
    """`warm`: the warm group whose teacher engines score every iteration's rollouts (not in the key)."""
    return run_core(
        f"teacher_logprobs[iter={iteration}]", store_root, parent_run_id,
        lambda store: run_teacher_logprobs(cfg, rollouts, teacher, store, warm),
    )  # fmt: skip
