"""Prefect tasks of the RL stages: the policy (and critic) update, VAPO's value pretraining, and PRIME's implicit
PRM update and process rewards."""

from __future__ import annotations

from posttrain_core.artifacts import ArtifactRef
from posttrain_core.config import RLConfig
from posttrain_core.stage import key_for
from posttrain_core.train.prm import SCORE_STAGE as PROCESS_STAGE
from posttrain_core.train.prm import STAGE as PRM_STAGE
from posttrain_core.train.prm import PRMSettings, prm_inputs, run_prm_update, run_process_rewards
from posttrain_core.train.rl_stage import (
    STAGE,
    VALUE_STAGE,
    NextRollout,
    run_rl_update,
    run_value_pretrain,
    update_inputs,
)
from posttrain_core.warm import WarmGroup
from tasks.common import run_core, stage_task


def _update_key(p, store):
    inputs = update_inputs(
        p["scored"], p["policy"], p["reference"], p.get("critic"), p.get("teacher"), p.get("sampler"), p.get("process")
    )
    return key_for(STAGE, p["cfg"], inputs)


@stage_task(STAGE, _update_key, run_name="rl_update[iter={iteration}]")
def rl_update(
    cfg: RLConfig,
    scored: list[ArtifactRef],
    policy: ArtifactRef,
    reference: ArtifactRef,
    critic: ArtifactRef | None = None,
    iteration: int = 0,
    store_root: str | None = None,
    parent_run_id: str | None = None,
    warm: WarmGroup | None = None,
    next_rollout: NextRollout | None = None,
    teacher: list[ArtifactRef] | None = None,
    sampler: ArtifactRef | None = None,
    process: ArtifactRef | None = None,
) -> ArtifactRef:
    """`warm` (the warm group) and `next_rollout` (the rollout that follows, started early) are not part
    of the cache key: they change how fast the artifact is made, not the artifact."""
    return run_core(
        f"rl_update[iter={iteration}]", store_root, parent_run_id,
        lambda store: run_rl_update(
            cfg, scored, policy, reference, store, critic, warm, next_rollout, teacher, sampler, process
        ),
    )  # fmt: skip


@stage_task(
    VALUE_STAGE, lambda p, store: key_for(VALUE_STAGE, p["cfg"], {"scored": p["scored"], "policy": p["policy"]})
)
def value_pretrain(
    cfg: RLConfig,
    scored: ArtifactRef,
    policy: ArtifactRef,
    store_root: str | None = None,
    parent_run_id: str | None = None,
    warm: WarmGroup | None = None,
) -> ArtifactRef:
    return run_core(
        VALUE_STAGE, store_root, parent_run_id, lambda store: run_value_pretrain(cfg, scored, policy, store, warm)
    )


def _prm_task(stage: str, run, doc: str):
    """PRIME's two stage tasks share their parameters: (cfg, scored, policy that sampled them, PRM, its reference)."""

    def key(p, store):
        return key_for(stage, PRMSettings.of(p["cfg"]), prm_inputs(p["scored"], p["policy"], p["prm"], p["reference"]))

    @stage_task(stage, key, run_name=f"{stage}[iter={{iteration}}]")
    def prm_stage(
        cfg: RLConfig,
        scored: list[ArtifactRef],
        policy: ArtifactRef,
        prm: ArtifactRef,
        reference: ArtifactRef,
        iteration: int = 0,
        store_root: str | None = None,
        parent_run_id: str | None = None,
        warm: WarmGroup | None = None,
    ) -> ArtifactRef:
        return run_core(
            f"{stage}[iter={iteration}]", store_root, parent_run_id,
            lambda store: run(cfg, scored, policy, prm, reference, store, warm),
        )  # fmt: skip

    prm_stage.__doc__ = doc
    return prm_stage


prm_update = _prm_task(PRM_STAGE, run_prm_update, "PRIME: PRM(k) from PRM(k-1) = `prm` on iteration k's rows.")
process_rewards = _prm_task(
    PROCESS_STAGE, run_process_rewards, "PRIME: `prm`'s process rewards of iteration k's rows, for the advantage."
)
