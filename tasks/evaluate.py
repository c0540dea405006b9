"""Prefect task of the evaluate stage (held-out answers from the rollout engines, scored by a verifier)."""

from __future__ import annotations

from posttrain_core.artifacts import ArtifactRef
from posttrain_core.config import EvalConfig
from posttrain_core.evaluate import STAGE, run_evaluate
from posttrain_core.stage import key_for
from posttrain_core.warm import WarmGroup
from tasks.common import run_core, stage_task


@stage_task(
    STAGE,
    lambda p, store: key_for(STAGE, p["cfg"], {"prompts": p["prompts"], "model": p["model"]}),
    run_name="evaluate[{label}]",
)
def evaluate(
    cfg: EvalConfig,
    prompts: ArtifactRef,
    model: ArtifactRef,
    label: str = "model",
    store_root: str | None = None,
    parent_run_id: str | None = None,
    warm: WarmGroup | None = None,
) -> ArtifactRef:
    """`label` names the task run (`evaluate[iter=0]`, `evaluate[base]`); `warm`: the warm group whose engines
    generate (not part of the cache key)."""
    return run_core(
        f"evaluate[{label}]", store_root, parent_run_id, lambda store: run_evaluate(cfg, prompts, model, store, warm)
    )
